"""Offline API: prompts in, finished generations out."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.outputs import RequestMetrics, TokenLogprob
from kvmesh.engine.sampling import SamplingParams


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
    ) -> list[GenerationResult]:
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        order: list[str] = []
        prompt_ids: dict[str, list[int]] = {}
        for prompt, p in zip(prompts, params):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = f"gen-{next(self._ids)}"
            self.engine.add_request(rid, ids, p)
            order.append(rid)
            prompt_ids[rid] = ids
        results: dict[str, GenerationResult] = {}
        logprobs: dict[str, list[TokenLogprob]] = {rid: [] for rid in order}
        while len(results) < len(order):
            for out in self.engine.step():
                if out.logprobs:
                    logprobs[out.request_id].extend(out.logprobs)
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
                    )
        return [results[rid] for rid in order]

    def chat(
        self,
        conversations: Sequence[list[dict]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
        return self.generate(prompts, params)
