"""From an API request to engine sampling parameters: pure functions, no I/O.

Defaults follow OpenAI: temperature 1, top_p 1; completions generate 16 tokens
unless told otherwise, chat generates up to the end of the context.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvmesh.engine.model.message_ends import message_ends
from kvmesh.engine.sampling import InvalidSamplingParams, SamplingParams
from kvmesh.engine.structured.grammar import InvalidGrammarError, StructuredOutput
from kvmesh.engine.api import errors, tools
from kvmesh.engine.api.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, _SamplingFields

if TYPE_CHECKING:
    from kvmesh.engine.model.tokenizer import Tokenizer

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_CHOICES = 256  # engine sequences one request may start (prompts x n)
_SEED_SPACE = 2**63


@dataclass(frozen=True)
class Limits:
    """What bounds one sequence: the model length and the KV pool (in tokens)."""

    max_model_len: int
    kv_capacity_tokens: int

    @property
    def max_total_tokens(self) -> int:
        return min(self.max_model_len, self.kv_capacity_tokens)


@dataclass(frozen=True)
class ChoiceSpec:
    """One engine sequence of a request: response choice `index` continues prompt `prompt_index`."""

    index: int
    prompt_index: int
    params: SamplingParams


def derive_seed(seed: int | None, choice: int) -> int | None:
    """Seed of choice `choice`: the request's seed for choice 0, a stable hash of (seed, choice) after.

    So n=1 and the first of n choices sample alike, and every choice is
    reproducible but differs from the others.
    """
    if seed is None or choice == 0:
        return seed
    digest = hashlib.sha256(f"kvmesh-choice:{seed}:{choice}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % _SEED_SPACE


def check_text(text: str, param: str) -> str:
    """Refuse text that is not valid Unicode (a lone surrogate such as "\\ud800" in JSON):
    it cannot be tokenized, and it is the client's error, so a 400 naming `param`."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise errors.invalid_request(
            f"'{param}' is not valid Unicode text: it holds a lone surrogate "
            f"{text[e.start]!r} at position {e.start}", param) from None
    return text


def resolve_max_tokens(requested: int | None, default: int | None, prompt_len: int, limits: Limits,
                       prompt_param: str = "messages") -> int:
    """How many tokens to generate; raise a 400 naming the limit when prompt + max_tokens does not fit.

    `default=None` means "up to the end of the context" (chat). `prompt_param` is the field the
    400 names: "messages" for chat, "prompt" for completions.
    """
    if requested is not None and requested < 1:
        raise errors.invalid_request(f"max_tokens must be at least 1, got {requested}", "max_tokens")
    room = limits.max_total_tokens - prompt_len
    if requested is None and default is None:
        if room < 1:
            raise errors.context_length_exceeded(_too_long(prompt_len, None, limits), prompt_param)
        return room
    max_tokens = requested if requested is not None else default
    assert max_tokens is not None
    if prompt_len + max_tokens > limits.max_total_tokens:
        raise errors.context_length_exceeded(_too_long(prompt_len, max_tokens, limits), prompt_param)
    return max_tokens


def _too_long(prompt_len: int, max_tokens: int | None, limits: Limits) -> str:
    if limits.kv_capacity_tokens < limits.max_model_len:
        limit = f"the KV cache of this server holds at most {limits.kv_capacity_tokens} tokens per sequence"
    else:
        limit = f"this model's maximum context length is {limits.max_model_len} tokens"
    if max_tokens is None:
        return f"{limit}; the prompt has {prompt_len} tokens, which leaves no room to generate. Shorten the prompt."
    return (f"{limit}; you requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
            f"{max_tokens} for the completion). Shorten the prompt or lower max_tokens.")


def logit_bias(req: _SamplingFields) -> dict[int, float]:
    """OpenAI's logit_bias (token ids as JSON object keys) with integer keys; a 400 for a key
    that is not a token id. Ranges are the engine's to check (SamplingParams.validate)."""
    out: dict[int, float] = {}
    for key, bias in (req.logit_bias or {}).items():
        if not key.strip().lstrip("-").isdigit():
            raise errors.invalid_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
        out[int(key)] = bias
    return out


def bad_words_token_ids(tokenizer: Tokenizer | None, words: list[str] | None) -> list[list[int]]:
    """vLLM's ``bad_words`` as token sequences: each word (less leading whitespace) as it
    tokenizes at the start of a text, and after a space when that gives a different first token
    in as many tokens (the word in the middle of a text), as vLLM tokenizes them. A 400 naming the
    word when it is longer than the engine bans (``SamplingParams.MAX_BAD_WORD_TOKENS``)."""
    out: list[list[int]] = []
    if not words:
        return out
    if tokenizer is None:
        raise errors.invalid_request("bad_words needs the model's tokenizer", "bad_words")
    for i, word in enumerate(words):
        plain = tokenizer.encode(check_text(word.lstrip(), f"bad_words.{i}"))
        if len(plain) > SamplingParams.MAX_BAD_WORD_TOKENS:
            raise errors.invalid_request(f"bad_words.{i} is {len(plain)} tokens long; a bad word may have at most "
                                         f"{SamplingParams.MAX_BAD_WORD_TOKENS}", f"bad_words.{i}")
        out.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip())
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


def check_completion_unsupported(req: CompletionRequest) -> None:
    if req.suffix:
        raise errors.unsupported_parameter("suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise errors.unsupported_parameter("best_of", "it must equal n when given")
    if req.echo and req.logprobs is not None and req.stream:
        raise errors.unsupported_parameter("echo", "echo with logprobs is served without streaming; "
                                           "send stream=false, or prompt_logprobs with the stream")


def check_chat_unsupported(req: ChatCompletionRequest) -> None:
    tool_setup(req)  # a 400 for malformed tools or a tool_choice not among them
    if req.response_format is not None and req.response_format.type not in ("text", "json_object", "json_schema"):
        raise errors.unsupported_parameter("response_format", f"type {req.response_format.type!r} (text, "
                                           "json_object and json_schema are served)")
    if req.top_logprobs is not None and not req.logprobs:
        raise errors.invalid_request("top_logprobs requires logprobs=true", "top_logprobs")
    if req.top_logprobs is not None and req.top_logprobs > SamplingParams.MAX_LOGPROBS:
        raise errors.invalid_request(
            f"top_logprobs must be between 0 and {SamplingParams.MAX_LOGPROBS}, got {req.top_logprobs}",
            "top_logprobs")


def chat_logprobs(req: ChatCompletionRequest) -> int | None:
    if not req.logprobs:
        return None
    return req.top_logprobs or 0


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as the chat template expects them: plain string contents, OpenAI's `developer` as `system`."""
    out: list[dict[str, str]] = []
    for i, m in enumerate(messages):
        if m.content is None:
            text = ""
        elif isinstance(m.content, str):
            text = m.content
        else:
            parts = []
            for part in m.content:
                if part.type != "text" or part.text is None:
                    raise errors.unsupported_parameter(
                        f"messages.{i}.content", f"content part type {part.type!r} (only text is served)")
                parts.append(part.text)
            text = "".join(parts)
        check_text(text, f"messages.{i}.content")
        out.append({"role": "system" if m.role == "developer" else m.role, "content": text})
    return out


def completion_prompt_ids(tokenizer: Tokenizer, req: CompletionRequest) -> list[list[int]]:
    """Token ids of each prompt of a completions request, exactly as the engine runs them.

    The one place completions prompts are tokenized: the server and the router both call it, so
    the router hashes the very tokens the engine will cache. Raises a 400 for an empty prompt.
    """
    prompts: list[list[int]] = []
    for i, p in enumerate(req.prompts()):
        ids = tokenizer.encode(check_text(p, "prompt")) if isinstance(p, str) else list(p)
        if not ids:
            raise errors.invalid_request(f"prompt {i} is empty; send at least one token", "prompt")
        prompts.append(ids)
    return prompts


def tool_setup(req: _SamplingFields) -> tools.ToolSetup | None:
    """The chat request's tools (api/tools.py), None for none or tool_choice "none"."""
    if not isinstance(req, ChatCompletionRequest):
        return None
    return tools.parse_tools(req.tools, req.tool_choice, req.parallel_tool_calls)


def chat_prompt_ids(tokenizer: Tokenizer, req: ChatCompletionRequest, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a chat request's prompt (chat template with the generation prompt appended),
    its tools and tool turns rendered as api/tools.py says.

    Shared by the server and the router like ``completion_prompt_ids``; raises a 400 when the
    messages cannot be rendered with the model's template.
    """
    from kvmesh.engine.model.tokenizer import ChatTemplateError

    msgs, kwargs = tools.render_history(chat_messages(req.messages), req.messages, tool_setup(req),
                                        bool(getattr(tokenizer, "template_takes_tools", False)))
    try:
        return list(tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, **kwargs))
    except ChatTemplateError as e:
        raise errors.invalid_request(str(e), "messages") from None


def chat_message_ends(tokenizer: Tokenizer, req: ChatCompletionRequest, ids: Sequence[int]) -> tuple[int, ...]:
    """Where in ``ids`` (``chat_prompt_ids(tokenizer, req)``) each message before the last ends
    (engine/model/message_ends.py, over the same render): the end of the system message and of
    each earlier turn is where the next user's prompt leaves this one, so a hybrid model
    checkpoints there (``Request.state_hints``)."""
    msgs, kwargs = tools.render_history(chat_messages(req.messages), req.messages, tool_setup(req),
                                        bool(getattr(tokenizer, "template_takes_tools", False)))
    return message_ends(tokenizer, msgs, ids, **kwargs)


STATE_HINTS_HEADER = "x-kvmesh-state-hints"
"""Prompt positions worth a hybrid model's checkpoint, comma-separated (the router sends the
branch points its fleet reported and where the fleet's cached prefixes of the prompt end)."""
MAX_STATE_HINTS = 64


def parse_state_hints(value: str | None) -> tuple[int, ...]:
    """``STATE_HINTS_HEADER``'s positions; a 400 naming the header for anything but up to
    ``MAX_STATE_HINTS`` comma-separated non-negative integers."""
    if not value:
        return ()
    parts = value.split(",")
    if len(parts) > MAX_STATE_HINTS or not all(p.strip().isdigit() for p in parts):
        raise errors.invalid_request(f"header {STATE_HINTS_HEADER} must be at most {MAX_STATE_HINTS} "
                                     f"comma-separated token positions, got {value[:80]!r}", STATE_HINTS_HEADER)
    return tuple(int(p) for p in parts)


def format_state_hints(positions: Sequence[int]) -> str:
    return ",".join(str(p) for p in positions[:MAX_STATE_HINTS])


_STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                    "json_object": "json_object"}


def _structured_from(kind: str, value: Any, param: str) -> StructuredOutput:
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise InvalidGrammarError(f"'{param}' is not valid JSON: {e}", param) from None
        return StructuredOutput.json_schema(value, param)
    if kind == "choice":
        return StructuredOutput.choice(value, param)
    if kind == "json_object":
        return StructuredOutput("json_object", "", param)
    if not isinstance(value, str) or not value:
        raise InvalidGrammarError(f"'{param}' must be a non-empty string", param)
    return StructuredOutput(kind, value, param)


def structured_output(req: _SamplingFields) -> StructuredOutput | None:
    """The request's output constraint, from chat's ``response_format`` or vLLM's
    ``structured_outputs`` / ``guided_*`` fields; a 400 naming the field when there are several
    or one is malformed. Whether the grammar compiles is the engine's to say."""
    found: list[tuple[str, Any, str]] = []
    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt.type == "json_object":
        found.append(("json_object", None, "response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise errors.invalid_request("response_format of type json_schema needs json_schema.schema",
                                         "response_format.json_schema.schema")
        found.append(("json_schema", fmt.json_schema.json_schema, "response_format.json_schema.schema"))
    so = req.structured_outputs or {}
    for key, value in so.items():
        if key in _STRUCTURED_KEYS and value is not None and value is not False:
            found.append((_STRUCTURED_KEYS[key], value, f"structured_outputs.{key}"))
    setup = tool_setup(req)
    if setup is not None and setup.constrained:
        found.append(("grammar", tools.grammar(setup), "tool_choice"))
    for field_name, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"),
                             ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(req, field_name)
        if value is not None:
            found.append((kind, value, field_name))
    if not found:
        return None
    if len(found) > 1:
        raise errors.invalid_request("send at most one output constraint; got " + ", ".join(p for _, _, p in found),
                                     found[1][2])
    kind, value, param = found[0]
    try:
        return _structured_from(kind, value, param)
    except InvalidGrammarError as e:
        raise errors.invalid_request(str(e), e.param) from None


def prompt_logprobs(req: _SamplingFields) -> int | None:
    """How many top alternatives to score each prompt token with (None: not scored): vLLM's
    ``prompt_logprobs``, or completions' ``echo`` with ``logprobs``, which reports the prompt's."""
    want = req.prompt_logprobs
    if isinstance(req, CompletionRequest) and req.echo and req.logprobs is not None:
        want = max(want or 0, req.logprobs)
    return want


def sampling_params(req: _SamplingFields, max_tokens: int, logprobs: int | None,
                    tokenizer: Tokenizer | None = None) -> SamplingParams:
    """The engine's parameters for choice 0 of `req`; raises a 400 naming the bad parameter.
    ``tokenizer`` tokenizes ``bad_words`` (a request with some needs it)."""
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_p=1.0 if req.top_p is None else float(req.top_p),
        top_k=-1 if req.top_k is None or req.top_k == 0 else req.top_k,
        min_p=0.0 if req.min_p is None else float(req.min_p),
        seed=req.seed,
        stop=req.stop_list(),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        include_stop_str_in_output=req.include_stop_str_in_output,
        presence_penalty=0.0 if req.presence_penalty is None else req.presence_penalty,
        frequency_penalty=0.0 if req.frequency_penalty is None else req.frequency_penalty,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=logit_bias(req),
        min_tokens=req.min_tokens,
        prompt_logprobs=prompt_logprobs(req),
        allowed_token_ids=None if req.allowed_token_ids is None else list(req.allowed_token_ids),
        bad_words_token_ids=bad_words_token_ids(tokenizer, req.bad_words),
        structured=structured_output(req),
    )
    try:
        return params.validate()
    except InvalidSamplingParams as e:
        raise errors.invalid_request(str(e), _param_of(str(e))) from None


def _param_of(message: str) -> str | None:
    """The engine's messages start with the parameter's name ("top_p must be ...")."""
    head = message.split(" ", 1)[0]
    return head if head.replace("_", "").isalpha() else None


def expand_choices(base: SamplingParams, n: int, num_prompts: int) -> list[ChoiceSpec]:
    """n choices per prompt, indexed prompt-major as OpenAI does (index = prompt * n + i)."""
    specs = []
    for p in range(num_prompts):
        for i in range(n):
            # A copy per sequence: the engine owns the params it is handed.
            params = dataclasses.replace(base, seed=derive_seed(base.seed, i), stop=list(base.stop),
                                         stop_token_ids=list(base.stop_token_ids),
                                         logit_bias=dict(base.logit_bias),
                                         bad_words_token_ids=[list(w) for w in base.bad_words_token_ids])
            specs.append(ChoiceSpec(index=p * n + i, prompt_index=p, params=params))
    return specs
