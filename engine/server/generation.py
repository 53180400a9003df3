"""Serve /v1/completions and /v1/chat/completions on top of the AsyncEngine.

A request becomes a `Prepared` (prompts tokenized, one sampling-params set per
choice, all validation done) before anything reaches the engine, so every 4xx
is decided up front and never disturbs other requests. Then its n choices run
as n engine sequences (`{id}-{index}`) in one `RequestGroup`, streamed as SSE
chunks or collected into one body.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvmesh.engine.outputs import RequestOutput, TokenLogprob
from kvmesh.engine.roles import Handoff
from kvmesh.engine.api import errors, params
from kvmesh.engine.api.tool_stream import CallStream, parse_calls
from kvmesh.engine.api.tools import ToolSetup
from kvmesh.engine.server import responses
from kvmesh.engine.server.async_engine import AsyncEngine, RequestGroup, SeqSubmission
from kvmesh.engine.api.errors import APIError
from kvmesh.engine.api.protocol import ChatCompletionRequest, CompletionRequest
from kvmesh.engine.server.streaming import EventStreamResponse, watch_disconnect


@dataclass
class Prepared:
    """A validated request, ready to submit."""

    kind: Literal["completion", "chat"]
    request_id: str
    created: int
    model: str
    prompts: list[list[int]]
    choices: list[params.ChoiceSpec]
    stream: bool
    include_usage: bool
    num_top_logprobs: int | None
    priority: int = 0
    echo_texts: list[str] | None = None  # completions with echo=true: the prompt text per prompt
    cache_salt: str | None = None
    """The request's prefix-cache namespace (``block_hash.chain_root``)."""
    tools: ToolSetup | None = None
    """Chat with tools: calls are parsed out of each choice's text (api/tools.py)."""
    report_prompt_logprobs: bool = False
    """The request asked for vLLM's ``prompt_logprobs``: each choice carries them."""
    state_hints: tuple[int, ...] = ()
    """Hybrid models: prompt positions worth a checkpoint (a chat prompt's message ends)."""

    def seq_id(self, index: int) -> str:
        return f"{self.request_id}-{index}"


@dataclass
class ChoiceState:
    """What one choice accumulated so far."""

    index: int
    prompt_index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_tokens: int = 0
    num_cached: int = 0
    finish_reason: str | None = None
    text_offset: int = 0
    prompt_logprobs: list[TokenLogprob] | None = None


def engine_error(exc: Exception, prompt_param: str = "messages") -> APIError:
    """Map an engine validation error from add_request to its API error."""
    from kvmesh.engine.engine import DuplicateRequestError, PromptTooLongError
    from kvmesh.engine.sampling import InvalidSamplingParams
    from kvmesh.engine.structured.grammar import InvalidGrammarError

    if isinstance(exc, InvalidGrammarError):
        return errors.invalid_request(str(exc), exc.param)
    if isinstance(exc, PromptTooLongError):
        return errors.context_length_exceeded(str(exc), prompt_param)
    if isinstance(exc, DuplicateRequestError):
        return errors.internal_error(str(exc))
    if isinstance(exc, (InvalidSamplingParams, ValueError)):
        return errors.invalid_request(str(exc))
    return errors.internal_error(f"{type(exc).__name__}: {exc}")


class Serving:
    """The generation endpoints' logic; the FastAPI routes only parse and delegate."""

    def __init__(self, aengine: AsyncEngine, served_names: list[str],
                 count_error: Callable[[str], None] = lambda code: None) -> None:
        self.aengine = aengine
        self.served_names = served_names
        self.count_error = count_error

    # ---- preparation ------------------------------------------------------------------
    @property
    def _engine(self) -> Any:
        return self.aengine.engine

    def _limits(self) -> params.Limits:
        e = self._engine
        return params.Limits(max_model_len=e.max_model_len,
                             kv_capacity_tokens=e.num_kv_blocks * e.config.block_size)

    def _model(self, requested: str | None) -> str:
        if requested is None or requested == "":
            return self.served_names[0]
        if requested not in self.served_names:
            raise errors.model_not_found(requested, self.served_names)
        return requested

    def prepare_completion(self, req: CompletionRequest, headers: Mapping[str, str] | None = None) -> Prepared:
        model = self._model(req.model)
        hints = params.parse_state_hints((headers or {}).get(params.STATE_HINTS_HEADER))
        params.check_completion_unsupported(req)
        tok = self._engine.tokenizer
        prompts = params.completion_prompt_ids(tok, req)
        if len(prompts) * req.n > params.MAX_CHOICES:
            raise errors.invalid_request(
                f"{len(prompts)} prompts x n={req.n} is more than {params.MAX_CHOICES} sequences per request", "n")
        choices = self._choices(req, prompts, params.COMPLETIONS_DEFAULT_MAX_TOKENS, req.logprobs)
        echo = None
        if req.echo:
            echo = [p if isinstance(p, str) else tok.decode(p) for p in req.prompts()]
        return Prepared("completion", f"cmpl-{uuid.uuid4().hex}", int(time.time()), model, prompts, choices,
                        req.stream, req.include_usage, req.logprobs, req.priority, echo, req.cache_salt,
                        report_prompt_logprobs=req.prompt_logprobs is not None, state_hints=hints)

    def prepare_chat(self, req: ChatCompletionRequest, headers: Mapping[str, str] | None = None) -> Prepared:
        """``headers``: the request's, for the router's ``params.STATE_HINTS_HEADER``."""
        model = self._model(req.model)
        routed = params.parse_state_hints((headers or {}).get(params.STATE_HINTS_HEADER))
        params.check_chat_unsupported(req)
        ids = params.chat_prompt_ids(self._engine.tokenizer, req)
        # Hybrid models reuse a prefix only where a checkpoint is: at the ends of earlier messages.
        hybrid = getattr(self._engine, "is_hybrid", False)
        hints = routed + params.chat_message_ends(self._engine.tokenizer, req, ids) if hybrid else ()
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        lp = params.chat_logprobs(req)
        choices = self._choices(req, [ids], None, lp, max_tokens)
        return Prepared("chat", f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model, [ids], choices,
                        req.stream, req.include_usage, lp, req.priority, cache_salt=req.cache_salt,
                        tools=params.tool_setup(req), report_prompt_logprobs=req.prompt_logprobs is not None,
                        state_hints=hints)

    def _choices(self, req: Any, prompts: list[list[int]], default_max: int | None, logprobs: int | None,
                 max_tokens: int | None = None) -> list[params.ChoiceSpec]:
        limits = self._limits()
        requested = max_tokens if max_tokens is not None else req.max_tokens
        out: list[params.ChoiceSpec] = []
        prompt_param = "prompt" if isinstance(req, CompletionRequest) else "messages"
        for pi, ids in enumerate(prompts):
            mt = params.resolve_max_tokens(requested, default_max, len(ids), limits, prompt_param)
            base = params.sampling_params(req, mt, logprobs, self._engine.tokenizer)
            for spec in params.expand_choices(base, req.n, 1):
                out.append(params.ChoiceSpec(index=pi * req.n + spec.index, prompt_index=pi, params=spec.params))
        return out

    # ---- execution --------------------------------------------------------------------
    def submit(self, prep: Prepared, arrival_time: float, handoff: Handoff | None = None) -> RequestGroup:
        """Start every choice of ``prep``, each with ``handoff`` as its role in a KV handoff."""
        seqs = [SeqSubmission(prep.seq_id(c.index), prep.prompts[c.prompt_index], c.params, handoff,
                              prep.cache_salt, prep.state_hints) for c in prep.choices]
        try:
            return self.aengine.submit(seqs, priority=prep.priority, arrival_time=arrival_time)
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - engine validation errors become 4xx
            raise engine_error(e, "prompt" if prep.kind == "completion" else "messages") from None

    async def compile_grammar(self, prep: Prepared) -> Prepared:
        """Compile the request's output grammar, if any, on a worker thread (cached by spec), so
        neither the event loop nor the engine step ever waits for a new schema; a 400 naming the
        field for one the engine cannot constrain to."""
        spec = prep.choices[0].params.structured if prep.choices else None
        if spec is not None:
            try:
                await asyncio.to_thread(self._engine.grammars.prepare, spec)
            except ValueError as e:
                raise engine_error(e) from None
        return prep

    async def respond(self, prep: Prepared, request: Request, arrival_time: float) -> Response | EventStreamResponse:
        return await self.respond_group(prep, self.submit(prep, arrival_time), request)

    async def respond_group(self, prep: Prepared, group: RequestGroup,
                            request: Request) -> Response | EventStreamResponse:
        """Stream or collect a submitted group's outputs as the OpenAI response."""
        if prep.stream:
            return EventStreamResponse(self._stream(prep, group), on_disconnect=lambda: self.aengine.abort(group))
        watcher = watch_disconnect(request.receive, lambda: self.aengine.abort(group))
        try:
            return JSONResponse(await self._collect(prep, group))
        finally:
            watcher.cancel()
            self.aengine.release(group)

    def _states(self, prep: Prepared) -> dict[str, ChoiceState]:
        return {prep.seq_id(c.index): ChoiceState(c.index, c.prompt_index) for c in prep.choices}

    def _token_text(self) -> Any:
        return _token_text_fn(self._engine.tokenizer)

    def _usage(self, prep: Prepared, states: dict[str, ChoiceState]) -> dict[str, Any]:
        prompt_tokens = sum(len(p) for p in prep.prompts)
        cached = 0
        for pi in range(len(prep.prompts)):
            # Prompt tokens count once per prompt; its cached share is what every choice got.
            cached += min((s.num_cached for s in states.values() if s.prompt_index == pi), default=0)
        return responses.usage(prompt_tokens, sum(s.num_tokens for s in states.values()), cached)

    def _logprobs_body(self, prep: Prepared, st: ChoiceState, entries: list[TokenLogprob]) -> dict[str, Any] | None:
        if prep.num_top_logprobs is None:
            return None
        if prep.kind == "chat":
            return responses.chat_logprobs(entries, self._token_text())
        body, st.text_offset = responses.completion_logprobs(entries, self._token_text(), st.text_offset,
                                                             prep.num_top_logprobs)
        return body

    @staticmethod
    def _absorb(st: ChoiceState, out: RequestOutput) -> None:
        if out.finish_reason == "error":
            raise errors.engine_failed(out.error or "the request failed")
        st.num_tokens = out.num_output_tokens
        st.num_cached = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            st.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            st.finish_reason = out.finish_reason

    async def _collect(self, prep: Prepared, group: RequestGroup) -> dict[str, Any]:
        states = self._states(prep)
        while True:
            outs = await group.next_outputs()
            if not outs:
                break
            for out in outs:
                st = states[out.request_id]
                self._absorb(st, out)
                if out.text_delta:
                    st.text.append(out.text_delta)
                if out.logprobs:
                    st.logprobs.extend(out.logprobs)
        choices = []
        for st in sorted(states.values(), key=lambda s: s.index):
            text = "".join(st.text)
            if prep.kind == "chat":
                lp = self._logprobs_body(prep, st, st.logprobs)
                calls: list[dict[str, Any]] = []
                content: str | None = text
                if prep.tools is not None:
                    content, calls = parse_calls(text, prep.tools)
                reason = "tool_calls" if calls and st.finish_reason == "stop" else st.finish_reason
                choices.append(responses.chat_choice(st.index, content, reason, lp, calls))
            else:
                if prep.echo_texts is not None:
                    st.text_offset = len(prep.echo_texts[st.prompt_index])
                    text = prep.echo_texts[st.prompt_index] + text
                lp = self._logprobs_body(prep, st, st.logprobs)
                if lp is not None and prep.echo_texts is not None and st.prompt_logprobs is not None:
                    head = responses.completion_prompt_logprobs(prep.prompts[st.prompt_index], st.prompt_logprobs,
                                                                self._token_text(), prep.num_top_logprobs or 0)
                    lp = {k: head[k] + lp[k] for k in lp}
                choices.append(responses.completion_choice(st.index, text, st.finish_reason, lp))
            if prep.report_prompt_logprobs:
                choices[-1]["prompt_logprobs"] = responses.prompt_logprobs_list(st.prompt_logprobs or [],
                                                                                self._token_text())
        body = responses.chat_body if prep.kind == "chat" else responses.completion_body
        return body(prep.request_id, prep.created, prep.model, choices, self._usage(prep, states))

    async def _stream(self, prep: Prepared, group: RequestGroup) -> AsyncIterator[bytes]:
        rid, created, model = prep.request_id, prep.created, prep.model
        states = self._states(prep)
        chat = prep.kind == "chat"
        calls = {st.index: CallStream(prep.tools) for st in states.values()} if prep.tools is not None else {}
        try:
            head = []
            for st in sorted(states.values(), key=lambda s: s.index):
                if chat:
                    head.append(responses.sse(responses.chat_chunk(
                        rid, created, model, st.index, {"role": "assistant", "content": ""})))
                elif prep.echo_texts is not None:
                    echo = prep.echo_texts[st.prompt_index]
                    st.text_offset = len(echo)
                    head.append(responses.sse(responses.completion_chunk(
                        rid, created, model, responses.completion_choice(st.index, echo, None, None))))
            if head:
                yield b"".join(head)
            while True:
                outs = await group.next_outputs()
                if not outs:
                    break
                parts = []
                for out in outs:
                    st = states[out.request_id]
                    self._absorb(st, out)
                    reason = out.finish_reason if out.finished else None
                    scored = prep.report_prompt_logprobs and out.prompt_logprobs is not None
                    if not out.text_delta and not out.logprobs and reason is None and not scored:
                        continue  # text held back (possible stop string): nothing to say yet
                    lp = self._logprobs_body(prep, st, out.logprobs or [])
                    if chat:
                        deltas = self._chat_deltas(calls.get(st.index), out.text_delta, reason is not None)
                        if reason == "stop" and st.index in calls and calls[st.index].count:
                            reason = "tool_calls"
                        if not deltas and not lp and reason is None and not scored:
                            continue
                        # One chunk per delta, as OpenAI sends a call's pieces: logprobs ride on
                        # the first, the finish reason on the last.
                        deltas = deltas or [{}]
                        chunks = [responses.chat_chunk(rid, created, model, st.index, d,
                                                       reason if k == len(deltas) - 1 else None, lp if k == 0 else None)
                                  for k, d in enumerate(deltas)]
                    else:
                        chunks = [responses.completion_chunk(
                            rid, created, model, responses.completion_choice(st.index, out.text_delta, reason, lp))]
                    if scored:
                        chunks[0]["choices"][0]["prompt_logprobs"] = responses.prompt_logprobs_list(
                            out.prompt_logprobs, self._token_text())
                    parts.extend(responses.sse(c) for c in chunks)
                if parts:
                    yield b"".join(parts)
            if prep.include_usage:
                obj = "chat.completion.chunk" if chat else "text_completion"
                yield responses.sse(responses.usage_chunk(rid, created, model, obj, self._usage(prep, states)))
            yield responses.SSE_DONE
        except APIError as e:
            # Headers are gone already: report in-band, as OpenAI does.
            self.count_error(e.code)
            yield responses.sse(e.body())
            yield responses.SSE_DONE
        finally:
            self.aengine.release(group)

    @staticmethod
    def _chat_deltas(calls: CallStream | None, text: str, last: bool) -> list[dict[str, Any]]:
        """A chat choice's deltas for ``text``: the text itself, or with tools the text outside
        ``<tool_call>`` blocks and each call's first entry and argument pieces (api/tool_stream.py)."""
        if calls is None:
            return [{"content": text}] if text else []
        deltas = calls.feed(text)
        return deltas + calls.finish() if last else deltas


@functools.lru_cache(maxsize=8)
def _token_text_fn(tokenizer: Any) -> Any:
    """A cached id -> text function for logprobs (each token decoded on its own)."""

    @functools.lru_cache(maxsize=65536)
    def text(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    return text
