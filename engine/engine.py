"""LLMEngine: the synchronous core that the offline API and the server drive.

Thread model: `add_request` and `abort_request` may be called from any thread;
they only validate and enqueue. Everything else (scheduling, the KV manager,
the forward pass) runs inside `step()`, on whichever single thread drives the
engine, so engine state is never shared or copied across threads.
"""

from __future__ import annotations

import itertools
import logging
import operator
import queue
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvmesh.engine.config import ConfigError, EngineConfig
from kvmesh.engine.kv.block_hash import extra_key
from kvmesh.engine.kv.events import KVEvent, KVEventLog
from kvmesh.engine.kv.kv_manager import KVCacheManager
from kvmesh.engine.kv.tiers import KVTiers, TierSnapshot
from kvmesh.engine.model.attention import AttentionBackend
from kvmesh.engine.model.llama import LlamaModel
from kvmesh.engine.model.loader import LoadedModel, load_model
from kvmesh.engine.outputs import RequestMetrics, RequestOutput
from kvmesh.engine.request import Request, RequestStatus
from kvmesh.engine.runner import ModelRunner
from kvmesh.engine.sampling import SamplingParams
from kvmesh.engine.scheduler import Scheduler
from kvmesh.engine.stream import RequestStream

_CPU_DEFAULT_KV_BYTES = 2 << 30

log = logging.getLogger("kvmesh.engine")


class InvalidPromptError(ValueError):
    """The prompt is not a list of token ids in the model's vocabulary; the message says which."""


class EmptyPromptError(InvalidPromptError):
    """The prompt has no tokens: the model needs at least one to produce logits."""


class PromptTooLongError(ValueError):
    """The request exceeds a length limit (model length, KV cache, or with chunked prefill off
    the step budget); the message names the limit."""


class DuplicateRequestError(ValueError):
    """A request with this id is already in flight."""


def _check_token_ids(prompt_token_ids: Sequence[int], vocab: int) -> list[int]:
    """The prompt as a list of plain ints, each in [0, vocab).

    Runs once per request at the door, so a bad id never reaches a step: floats,
    bools and strings are refused rather than coerced.
    """
    if isinstance(prompt_token_ids, (str, bytes)) or not hasattr(prompt_token_ids, "__iter__"):
        raise InvalidPromptError(f"the prompt must be a list of token ids, got {type(prompt_token_ids).__name__}")
    try:
        ids = [operator.index(t) for t in prompt_token_ids]
    except TypeError:
        bad = next(t for t in prompt_token_ids if not hasattr(t, "__index__"))
        raise InvalidPromptError(f"prompt token ids must be integers, got {bad!r}") from None
    if any(isinstance(t, bool) for t in prompt_token_ids):
        raise InvalidPromptError("prompt token ids must be integers, got a bool")
    if not ids:
        raise EmptyPromptError("the prompt is empty; send at least one token")
    if not 0 <= min(ids) <= max(ids) < vocab:
        bad = next(t for t in ids if not 0 <= t < vocab)
        raise InvalidPromptError(f"prompt token ids must be in [0, {vocab}), got {bad}")
    return ids


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    num_kv_blocks: int
    num_free_blocks: int
    prefix_queries: int
    prefix_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    num_steps: int
    # Prompt tokens admitted but not yet computed (waiting and partly prefilled
    # requests): the prefill backlog the autoscaler sizes prefill pools on.
    queued_prefill_tokens: int = 0
    # The primary pool's geometry and evictions, and the tiers below it (host, cache node).
    kv_block_bytes: int = 0
    kv_evictions: int = 0
    tiers: tuple[TierSnapshot, ...] = ()


def _pick_backend(cfg: EngineConfig, device: torch.device) -> str:
    if cfg.attention_backend != "auto":
        if cfg.attention_backend == "triton" and device.type != "cuda":
            raise ConfigError("attention_backend 'triton' needs a CUDA device; use 'torch' on CPU")
        return cfg.attention_backend
    return "triton" if device.type == "cuda" else "torch"


def _num_kv_blocks(cfg: EngineConfig, loaded: LoadedModel, device: torch.device, dtype: torch.dtype) -> int:
    if cfg.num_kv_blocks is not None:
        return cfg.num_kv_blocks
    per_block = cfg.block_size * loaded.config.kv_bytes_per_token(dtype.itemsize)
    if cfg.kv_cache_bytes is not None:
        budget = cfg.kv_cache_bytes
    elif device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * cfg.kv_cache_memory_fraction)
    else:
        budget = _CPU_DEFAULT_KV_BYTES
    n = budget // per_block
    if n < 1:
        raise ConfigError(
            f"KV budget of {budget} bytes holds no block of {per_block} bytes "
            f"(block_size={cfg.block_size}); raise the KV memory budget"
        )
    return n


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None,
                 engine_id: str | None = None, debug_checks: bool = False) -> None:
        self.config = cfg = (config or EngineConfig()).validate()
        self.device = cfg.resolved_device()
        self.dtype = cfg.torch_dtype()
        if cfg.num_threads and self.device.type == "cpu":
            torch.set_num_threads(cfg.num_threads)
        self.loaded = loaded or load_model(cfg.model, self.dtype)
        self.model_config = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.model_id = self.loaded.model_id  # the block-hash identity (name @ weights digest)
        self.engine_id = engine_id or f"engine-{uuid.uuid4().hex[:8]}"
        self.debug_checks = debug_checks
        self.backend = AttentionBackend(_pick_backend(cfg, self.device))

        num_blocks = _num_kv_blocks(cfg, self.loaded, self.device, self.dtype)
        model_len = self.model_config.max_position_embeddings
        if cfg.max_model_len is not None:
            if cfg.max_model_len > model_len:
                raise ConfigError(f"max_model_len {cfg.max_model_len} exceeds the model's {model_len}")
            model_len = cfg.max_model_len
        self.max_model_len = model_len
        self.model = LlamaModel(self.model_config, self.loaded.weights, self.backend, self.dtype,
                                self.device, max_position=model_len)
        self.loaded.weights = {}  # the model holds fused copies; drop the originals
        self.runner = ModelRunner(self.model, num_blocks, cfg.block_size, self.dtype, seed=cfg.seed)
        if cfg.cuda_graphs and self.device.type == "cuda" and self.backend.name == "triton":
            sizes = tuple(b for b in cfg.cuda_graph_batch_sizes if b <= cfg.max_num_seqs)
            self.runner.capture_cuda_graphs(sizes, model_len)
        self.events = KVEventLog(self.engine_id)
        self.tiers: KVTiers | None = None
        self._kv_evictions = 0
        self.kv = KVCacheManager(
            num_blocks, cfg.block_size, cfg.enable_prefix_caching,
            extra_key(self.model_id, str(self.dtype).removeprefix("torch."),
                      cache_salt=cfg.cache_salt or None),
            on_event=self._on_kv_event, on_evict=self._on_evict,
        )
        self._cache_node = None
        if cfg.cpu_kv_bytes or cfg.cache_node:
            from kvmesh.engine.kv.tier_setup import build_tiers

            self.tiers, self._cache_node = build_tiers(cfg, self.kv, self.runner.kv_cache, self.events.publish)
        self.scheduler = Scheduler(self.kv, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   cfg.enable_chunked_prefill, tiers=self.tiers)
        self.num_kv_blocks = num_blocks
        self._requests: dict[str, Request] = {}
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live_ids: set[str] = set()
        self._lock = threading.Lock()
        self._arrival = itertools.count()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._num_steps = 0

    def _on_kv_event(self, event: KVEvent) -> None:
        self.events.publish(event)
        if self.tiers is not None:
            self.tiers.on_primary_event(event)

    def _on_evict(self, blocks: list) -> None:
        self._kv_evictions += len(blocks)
        if self.tiers is not None:
            self.tiers.on_evict(blocks)

    @property
    def waiting_on_transfers(self) -> bool:
        """True while some request waits for a cache-node fetch (a step may then schedule nothing)."""
        return self.scheduler.num_deferred > 0

    def close(self) -> None:
        """Release the cache-node connections (if any). Idempotent."""
        if self._cache_node is not None:
            self._cache_node.close()
            self._cache_node = None

    # ---- thread-safe entry points -------------------------------------------
    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """Everything add_request checks, without enqueuing; returns the prompt as a list of ints.

        Raises InvalidSamplingParams, InvalidPromptError (EmptyPromptError for no tokens) or
        PromptTooLongError. A request that passes can always be scheduled to completion.
        """
        params.validate()
        ids = _check_token_ids(prompt_token_ids, self.model_config.vocab_size)
        n = len(ids)
        if n + params.max_tokens > self.max_model_len:
            raise PromptTooLongError(
                f"this model's maximum context length is {self.max_model_len} tokens; the request has "
                f"{n} prompt tokens plus max_tokens={params.max_tokens}"
            )
        capacity = self.num_kv_blocks * self.config.block_size
        if n + params.max_tokens > capacity:
            raise PromptTooLongError(
                f"the KV cache holds {capacity} tokens; the request needs {n} prompt tokens plus "
                f"max_tokens={params.max_tokens}"
            )
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and n > budget:
            # Without chunking a prompt runs in one step or never: it would block the queue forever.
            raise PromptTooLongError(
                f"with chunked prefill off a prompt must fit in one step of max_num_batched_tokens={budget} "
                f"tokens; the prompt has {n}. Shorten it, raise max_num_batched_tokens or enable chunked prefill"
            )
        return ids

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                    priority: int = 0, arrival_time: float | None = None) -> None:
        """Validate (see check_request) and enqueue; the request joins at the next step."""
        ids = self.check_request(prompt_token_ids, params)
        gen = None
        if params.seed is not None and not params.greedy:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed)
        req = Request(
            request_id=request_id,
            prompt_token_ids=ids,
            params=params,
            metrics=RequestMetrics(arrival_time=arrival_time if arrival_time is not None else time.monotonic()),
            priority=priority,
            arrival_seq=next(self._arrival),
            generator=gen,
        )
        req.stream = RequestStream(self.tokenizer, req.prompt_token_ids, params)
        with self._lock:
            if request_id in self._live_ids:
                raise DuplicateRequestError(f"request id {request_id!r} is already in flight")
            self._live_ids.add(request_id)
        self._commands.put(("add", req))

    def abort_request(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self._live_ids)

    # ---- the step -------------------------------------------------------------
    def _drain_commands(self, outputs: list[RequestOutput]) -> None:
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._requests[arg.request_id] = arg
                self._prompt_tokens += arg.num_prompt_tokens
                self.scheduler.add(arg)
            else:
                req = self._requests.get(arg)
                if req is not None and not req.is_finished:
                    self.scheduler.finish(req, "abort")
                    outputs.append(self._finish_output(req))

    def _forget(self, req: Request, now: float) -> None:
        req.metrics.finished_time = now
        self._requests.pop(req.request_id, None)
        with self._lock:
            self._live_ids.discard(req.request_id)

    def _finish_output(self, req: Request) -> RequestOutput:
        self._forget(req, time.monotonic())
        return req.stream.abort_output(req)

    def _fail(self, reqs: list[Request], exc: Exception) -> list[RequestOutput]:
        """Finish `reqs` with finish_reason "error" and free their blocks, so a failure is
        reported to the requests it hit and the engine stays usable for everyone else."""
        message = f"{type(exc).__name__}: {exc}"
        log.error("step failed for %d request(s): %s", len(reqs), message, exc_info=exc)
        now = time.monotonic()
        outs = []
        for req in reqs:
            if req.is_finished:
                continue
            self.scheduler.finish(req, "error")
            self._forget(req, now)
            outs.append(req.stream.error_output(req, message))
        return outs

    def step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        self._drain_commands(outputs)
        sched = self.scheduler.schedule()
        if self.tiers is not None:
            self.tiers.flush()  # lower-tier saves and loads land before the forward pass
        if sched.is_empty:
            return outputs
        self._num_steps += 1
        now = time.monotonic()
        for s in sched.seqs:
            if s.request.metrics.first_scheduled_time is None:
                s.request.metrics.first_scheduled_time = now
        block_ids = [self.kv.block_ids(s.request.request_id) for s in sched.seqs]
        try:
            result = self.runner.execute(sched, block_ids)
        except Exception as exc:  # noqa: BLE001 - which request caused it is unknown: fail the batch
            return outputs + self._fail([s.request for s in sched.seqs], exc)
        full = self.scheduler.update_after_step(sched)
        if self.tiers is not None:
            self.tiers.after_step(full)
        if result is not None:
            now = time.monotonic()
            producing = [s.request for s in sched.seqs if s.produces_token]
            for req, tok, lp in zip(producing, result.token_ids, result.logprobs):
                req.append_token(tok)
                self._generation_tokens += 1
                m = req.metrics
                if m.first_token_time is None:
                    m.first_token_time = now
                m.last_token_time = now
                try:
                    out = req.stream.on_token(req, tok, lp, self.max_model_len)
                except Exception as exc:  # noqa: BLE001 - e.g. a detokenizer error: this request only
                    outputs.extend(self._fail([req], exc))
                    continue
                if out.finished:
                    self.scheduler.finish(req, out.finish_reason)
                    self._forget(req, now)
                outputs.append(out)
        if self.debug_checks:
            self.check_integrity()
        return outputs

    def check_integrity(self) -> None:
        """KV manager and lower-tier invariants (O(blocks); tests and debug runs)."""
        self.kv.check_integrity()
        if self.tiers is not None:
            self.tiers.check_integrity()

    @property
    def num_steps(self) -> int:
        """Steps that ran a forward pass; unchanged by a step that found nothing to schedule."""
        return self._num_steps

    def stats(self) -> EngineStats:
        ps = self.kv.prefix_stats()
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_usage=self.kv.usage,
            num_kv_blocks=self.num_kv_blocks,
            num_free_blocks=self.kv.num_free_blocks,
            prefix_queries=ps.queries,
            prefix_hits=ps.hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            num_steps=self._num_steps,
            queued_prefill_tokens=self.scheduler.queued_prefill_tokens,
            kv_block_bytes=self.config.block_size * self.model_config.kv_bytes_per_token(self.dtype.itemsize),
            kv_evictions=self._kv_evictions,
            tiers=tuple(self.tiers.snapshots()) if self.tiers is not None else (),
        )
