"""A small stand-in for LLMEngine that exercises only the HTTP layer in fast tests.

It follows the engine's interface and contracts (thread-safe add/abort that
take effect at the next step, validation errors raised synchronously, one
final "abort" output per aborted request, per-step deltas) but "generates"
deterministic bytes: token i of a request is byte (prompt[-1] + i + 1) mod
26 mapped to a lowercase letter, so expected texts are easy to compute.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import DuplicateRequestError, EmptyPromptError, EngineStats, PromptTooLongError
from kvmesh.engine.model.tokenizer import ChatTemplateError
from kvmesh.engine.outputs import RequestMetrics, RequestOutput, TokenLogprob
from kvmesh.engine.sampling import SamplingParams
from kvmesh.engine.structured.grammar import GrammarCompiler

EOS = 0
_OFFSET = 1  # token id = byte + 1


class FakeTokenizer:
    eos_token_ids = (EOS,)
    fingerprint = "fake-bytes-tokenizer"  # what /kv/info reports and a router compares
    vocab_size = 256 + _OFFSET

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [b + _OFFSET for b in text.encode()]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(i - _OFFSET for i in ids if i >= _OFFSET).decode(errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> list[int]:
        if any(m["role"] == "tool" for m in messages):
            raise ChatTemplateError("the fake template has no tool role")
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))


def fake_token(prompt: list[int], i: int) -> int:
    return ord("a") + (prompt[-1] + i + 1) % 26 + _OFFSET


def expected_text(prompt: list[int], n: int) -> str:
    return "".join(chr(fake_token(prompt, i) - _OFFSET) for i in range(n))


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    out: list[int] = field(default_factory=list)


@dataclass
class _ModelConfig:
    name: str = "fake-model"
    vocab_size: int = 300


class FakeEngine:
    """Serves up to `max_num_seqs` requests per step; `paused` holds every step until cleared."""

    def __init__(self, max_model_len: int = 64, num_kv_blocks: int = 32, block_size: int = 4,
                 max_num_seqs: int = 8, step_delay_s: float = 0.0) -> None:
        self.config = EngineConfig(block_size=block_size, max_num_seqs=max_num_seqs)
        self.model_config = _ModelConfig()
        self.model_id = self.model_config.name  # what a real engine hashes KV blocks under
        self.tokenizer = FakeTokenizer()
        self.max_model_len = max_model_len
        self.num_kv_blocks = num_kv_blocks
        self.step_delay_s = step_delay_s
        self.running = threading.Event()
        self.running.set()
        self._lock = threading.Lock()
        self._pending: list[_Req] = []
        self._aborts: list[str] = []
        self._live: dict[str, _Req] = {}
        self._active: list[_Req] = []
        self.generation_tokens = 0
        self.prompt_tokens = 0
        self.num_steps = 0
        self.step_calls = 0

    @functools.cached_property
    def grammars(self) -> GrammarCompiler:
        """The real grammar compiler over the tiny models' real BPE tokenizer (the fake's byte
        tokenizer is not one llguidance can read): a bad schema is refused as the engine would."""
        from .tiny_models import TINY_VOCAB, make_tiny_tokenizer

        return GrammarCompiler(make_tiny_tokenizer(), TINY_VOCAB, (EOS,))

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    priority: int = 0, arrival_time: float | None = None, handoff: object = None,
                    cache_salt: str | None = None, state_hints: Sequence[int] = ()) -> None:
        """The real engine's signature; the fake caches nothing, so a salt or hints change nothing."""
        if handoff is not None:
            raise ValueError("the fake engine takes no part in KV handoffs")
        params.validate()
        if params.structured is not None:
            self.grammars.prepare(params.structured)
        if not prompt_token_ids:
            raise EmptyPromptError("the prompt is empty; send at least one token")
        if any(not 0 <= t < self.model_config.vocab_size for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.model_config.vocab_size})")
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise PromptTooLongError(f"this model's maximum context length is {self.max_model_len} tokens")
        req = _Req(request_id, list(prompt_token_ids), params,
                   RequestMetrics(arrival_time=arrival_time if arrival_time is not None else time.monotonic()))
        with self._lock:
            if request_id in self._live:
                raise DuplicateRequestError(f"request id {request_id!r} is already in flight")
            self._live[request_id] = req
            self._pending.append(req)

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self._live)

    # The driver's idle hooks (a real engine runs KV transfer commands and expiries there).
    wake = None

    def has_pending_commands(self) -> bool:
        return False

    def has_timers(self) -> bool:
        return False

    def idle_tick(self) -> list[RequestOutput]:
        return []

    def _output(self, r: _Req, new: list[int], finished: bool, reason: str | None) -> RequestOutput:
        lps = [TokenLogprob(t, -0.5, [(t, -0.5), (t + 1, -1.5)]) for t in new] if r.params.logprobs is not None \
            else None
        return RequestOutput(r.rid, r.prompt, new, list(r.out), self.tokenizer.decode(new),
                             self.tokenizer.decode(r.out), finished, reason, 0, lps, r.metrics)

    def step(self) -> list[RequestOutput]:
        self.step_calls += 1
        self.running.wait()
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        outs: list[RequestOutput] = []
        with self._lock:
            pending, self._pending = self._pending, []
            aborts, self._aborts = self._aborts, []
        for r in pending:
            self.prompt_tokens += len(r.prompt)
            self._active.append(r)
        now = time.monotonic()
        for rid in aborts:
            r = next((x for x in self._active if x.rid == rid), None)
            if r is not None:
                self._active.remove(r)
                self._finish(r, now)
                outs.append(self._output(r, [], True, "abort"))
        batch = self._active[: self.config.max_num_seqs]
        if batch:
            self.num_steps += 1
        for r in batch:
            m = r.metrics
            m.first_scheduled_time = m.first_scheduled_time or now
            tok = fake_token(r.prompt, len(r.out))
            r.out.append(tok)
            self.generation_tokens += 1
            m.first_token_time = m.first_token_time or now
            m.last_token_time = now
            done = len(r.out) >= r.params.max_tokens
            if done:
                self._active.remove(r)
                self._finish(r, now)
            outs.append(self._output(r, [tok], done, "length" if done else None))
        return outs

    def _finish(self, r: _Req, now: float) -> None:
        r.metrics.finished_time = now
        with self._lock:
            self._live.pop(r.rid, None)

    def stats(self) -> EngineStats:
        running = min(len(self._active), self.config.max_num_seqs)
        used = sum(-(-(len(r.prompt) + len(r.out)) // self.config.block_size) for r in self._active)
        return EngineStats(
            num_running=running, num_waiting=len(self._active) - running,
            kv_usage=used / self.num_kv_blocks, num_kv_blocks=self.num_kv_blocks,
            num_free_blocks=self.num_kv_blocks - used, prefix_queries=self.prompt_tokens, prefix_hits=0,
            num_preemptions=0, prompt_tokens=self.prompt_tokens, generation_tokens=self.generation_tokens,
            num_steps=self.num_steps,
        )
