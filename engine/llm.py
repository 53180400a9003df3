"""Offline API: prompts in, finished generations out."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.model.message_ends import message_ends
from kvmesh.engine.outputs import RequestMetrics, TokenLogprob
from kvmesh.engine.sampling import SamplingParams


# A step may legitimately schedule nothing right after preempting every running request;
# this many in a row with requests pending can only be a request that never fits.
_MAX_IDLE_STEPS = 8


class EngineStalledError(RuntimeError):
    """Requests are pending but the engine can schedule none of them."""


class RequestFailedError(RuntimeError):
    """A request finished with an error inside the engine step; the message carries the cause."""


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    stop_reason: int | str | None
    num_cached_tokens: int
    logprobs: list[TokenLogprob] | None
    metrics: RequestMetrics
    prompt_logprobs: list[TokenLogprob] | None = None  # with SamplingParams.prompt_logprobs


class LLM:
    """Runs an LLMEngine to completion over a batch of prompts.

    Prompts are strings (tokenized without special tokens added: pass chat
    prompts through `chat`, or token ids for full control) or token id lists.
    """

    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None, **overrides) -> None:
        if engine is None:
            cfg = config or EngineConfig()
            for k, v in overrides.items():
                setattr(cfg, k, v)
            engine = LLMEngine(cfg)
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Sequence[str | list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        state_hints: Sequence[Sequence[int]] | None = None,
    ) -> list[GenerationResult]:
        """Run every prompt to completion; results in prompt order.

        ``state_hints``: per prompt, positions worth a hybrid model's checkpoint
        (``Request.state_hints``; ``chat`` passes each conversation's message ends).

        All prompts are validated before any is submitted, so a bad prompt raises its error
        (InvalidPromptError, PromptTooLongError, InvalidSamplingParams) and leaves the engine
        as it was. If a request fails inside a step, or the engine stops making progress, the
        batch's other requests are aborted and RequestFailedError / EngineStalledError is raised.
        """
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        if state_hints is not None and len(state_hints) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(state_hints)} lists of state hints")
        checked = [
            self.engine.check_request(self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt, p)
            for prompt, p in zip(prompts, params)
        ]
        prompt_ids = {f"gen-{next(self._ids)}": ids for ids in checked}
        order = list(prompt_ids)
        hints = state_hints if state_hints is not None else [()] * len(order)
        try:
            for rid, p, h in zip(order, params, hints):
                self.engine.add_request(rid, prompt_ids[rid], p, state_hints=h)
            results = self._run(prompt_ids)
        except BaseException:
            # Abort what this call submitted so that nothing outlives it in the engine.
            for rid in order:
                self.engine.abort_request(rid)
            raise
        return [results[rid] for rid in order]

    def _run(self, prompt_ids: dict[str, list[int]]) -> dict[str, GenerationResult]:
        results: dict[str, GenerationResult] = {}
        logprobs: dict[str, list[TokenLogprob]] = {rid: [] for rid in prompt_ids}
        scored: dict[str, list[TokenLogprob]] = {}
        idle = 0
        while len(results) < len(prompt_ids):
            before = self.engine.num_steps
            outs = self.engine.step()
            # Consecutive steps that neither run a forward nor report anything mean no
            # pending request can ever be scheduled; waiting longer would spin forever.
            idle = idle + 1 if not outs and self.engine.num_steps == before else 0
            if idle and getattr(self.engine, "waiting_on_transfers", False):
                # A request waits for its KV from a cache node (bounded by the transfer timeout).
                idle = 0
                time.sleep(0.001)
            if idle > _MAX_IDLE_STEPS:
                pending = [rid for rid in prompt_ids if rid not in results]
                raise EngineStalledError(
                    f"the engine made no progress in {idle} steps with {len(pending)} request(s) pending "
                    f"({', '.join(pending[:5])}); they were aborted"
                )
            for out in outs:
                if out.request_id not in prompt_ids:
                    continue  # the abort of a request from an earlier, failed call
                if out.finish_reason == "error":
                    raise RequestFailedError(f"request {out.request_id} failed: {out.error}")
                if out.logprobs:
                    logprobs[out.request_id].extend(out.logprobs)
                if out.prompt_logprobs is not None:
                    scored[out.request_id] = out.prompt_logprobs
                if out.finished:
                    results[out.request_id] = GenerationResult(
                        request_id=out.request_id,
                        prompt_token_ids=prompt_ids[out.request_id],
                        token_ids=out.output_token_ids,
                        text=out.text,
                        finish_reason=out.finish_reason or "stop",
                        stop_reason=out.stop_reason,
                        num_cached_tokens=out.num_cached_tokens,
                        logprobs=logprobs[out.request_id] or None,
                        metrics=out.metrics,
                        prompt_logprobs=scored.get(out.request_id),
                    )
        return results

    def chat(
        self,
        conversations: Sequence[list[dict]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
        # A hybrid model reuses a prefix only where a checkpoint is: at the ends of earlier messages.
        hints = [message_ends(self.tokenizer, c, ids) for c, ids in zip(conversations, prompts)] \
            if self.engine.is_hybrid else None
        return self.generate(prompts, params, hints)
