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
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from kvmesh.engine.config import ConfigError, EngineConfig, parse_dtype
from kvmesh.engine.block_hash import BlockHash, chain_root, extra_key
from kvmesh.engine.disagg.decode_side import DecodeRole, DecodeTransfers
from kvmesh.engine.disagg.errors import HandoffError
from kvmesh.engine.disagg.prefill_side import PrefillRole
from kvmesh.engine.kv.gather import scatter_blocks
from kvmesh.engine.kv.events import KVEvent, KVEventLog
from kvmesh.engine.kv.kv_manager import KVCacheManager
from kvmesh.engine.kv.hybrid_setup import build_state_manager
from kvmesh.engine.kv.hybrid_state import HybridStateManager, StepStatePlan
from kvmesh.engine.kv.slot_wire import scatter_state, slot_nbytes
from kvmesh.engine.kv.state_checkpoints import CheckpointStats
from kvmesh.engine.kv.tiers import KVTiers, TierSnapshot
from kvmesh.engine.model.attention import AttentionBackend
from kvmesh.engine.model.llama import LlamaModel
from kvmesh.engine.model.qwen3_5 import Qwen35Model
from kvmesh.engine.model.recurrent_state import StatePool
from kvmesh.engine.model.loader import LoadedModel, load_model
from kvmesh.engine.outputs import RequestMetrics, RequestOutput
from kvmesh.engine.request import Request, RequestStatus
from kvmesh.engine.roles import DecodeClaim, Handoff, PrefillHandoff
from kvmesh.engine.step_commands import Abort, Add, Call, Claim, StepCommand
from kvmesh.engine.runner import ModelRunner
from kvmesh.engine.prefill_pacer import PrefillPacer
from kvmesh.engine.tpot_gate import TpotGate
from kvmesh.engine.sampling import InvalidSamplingParams, SamplingParams
from kvmesh.engine.scheduler import Scheduler
from kvmesh.engine.stream import RequestStream
from kvmesh.engine.structured.grammar import GrammarCompiler
from kvmesh.engine.structured.masking import GrammarState
from kvmesh.engine.util.prefault import populate_in_background
from kvmesh.engine.util.weak_callback import weak_method

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
    # Prefill/decode handoffs: transfers reserved on this (decode) engine, requests whose blocks
    # this (prefill) engine holds for a decode engine, and the timeouts of both.
    kv_transfers_reserved: int = 0
    kv_transfer_blocks_reserved: int = 0
    kv_handoffs_held: int = 0
    kv_transfer_timeouts: int = 0
    # Hybrid models: the recurrent-state checkpoint pool (None without one).
    state_checkpoints: CheckpointStats | None = None
    # ... and every medium holding its checkpoints (gpu, cpu, remote), counted in checkpoints.
    state_tiers: tuple[TierSnapshot, ...] = ()


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
        self.dtype_choice = choice = cfg.dtype_choice()
        self.dtype = parse_dtype(choice.dtype)
        log.info("compute dtype %s (%s)", choice.dtype, choice.reason)
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
        hybrid = self.is_hybrid = self.model_config.is_hybrid
        num_checkpoints = 0
        if hybrid:
            self.model: LlamaModel | Qwen35Model = Qwen35Model(
                self.model_config, self.loaded.weights, self.backend, self.dtype, self.device, max_position=model_len)
            state_bytes = StatePool.bytes_per_slot(self.model_config, self.dtype.itemsize)
            if cfg.enable_prefix_caching:
                num_checkpoints = cfg.state_checkpoint_bytes // state_bytes
            log.info("hybrid model: %d DeltaNet layers, %d attention layers; %d state slots and %d checkpoints "
                     "of %d bytes each", len(self.model_config.linear_layers), self.model_config.num_kv_layers,
                     cfg.max_num_seqs, num_checkpoints, state_bytes)
        else:
            self.model = LlamaModel(self.model_config, self.loaded.weights, self.backend, self.dtype,
                                    self.device, max_position=model_len, quantized=self.loaded.quantized)
        self.loaded.weights, self.loaded.quantized = {}, {}  # the model holds fused copies; drop the originals
        self.runner = ModelRunner(self.model, num_blocks, cfg.block_size, self.dtype, seed=cfg.seed,
                                  eos_token_ids=tuple(self.tokenizer.eos_token_ids),
                                  num_state_slots=cfg.max_num_seqs if hybrid else 0,
                                  num_state_checkpoints=num_checkpoints)
        self.grammars = GrammarCompiler(getattr(self.tokenizer, "hf", None), self.model_config.vocab_size,
                                        tuple(self.tokenizer.eos_token_ids))
        if cfg.cuda_graphs and self.device.type == "cuda" and self.backend.name == "triton" and not hybrid:
            sizes = tuple(b for b in cfg.cuda_graph_batch_sizes if b <= cfg.max_num_seqs)
            self.runner.capture_cuda_graphs(sizes, model_len)
        self.events = KVEventLog(self.engine_id)
        self.tiers: KVTiers | None = None
        self._kv_evictions = 0
        # A hybrid model gets prefix hits only with checkpoints: a hit must also restore the
        # recurrent state at its end, which cannot be rebuilt from KV.
        self.kv = KVCacheManager(
            num_blocks, cfg.block_size, cfg.enable_prefix_caching and (not hybrid or num_checkpoints > 0),
            extra_key(self.model_id, str(self.dtype).removeprefix("torch."),
                      cache_salt=cfg.cache_salt or None),
            on_event=weak_method(self._on_kv_event), on_evict=weak_method(self._on_evict),
        )
        self._cache_node = None
        if cfg.cpu_kv_bytes or cfg.cache_node:
            from kvmesh.engine.kv.tier_setup import build_tiers

            self.tiers, self._cache_node = build_tiers(cfg, self.kv, self.runner.kv_cache, self.events.publish,
                                                        self.max_model_len)
        self.state_slots: HybridStateManager | None = None
        if hybrid:
            self.state_slots = build_state_manager(cfg, self.runner.states, self.model_config.linear_layers,
                                                   num_checkpoints, state_bytes, self.tiers, self.events.publish)
        self.pacer = PrefillPacer(cfg.tpot_slo_ms / 1e3) if cfg.tpot_slo_ms > 0 else None
        self.gate = TpotGate(cfg.admission_tpot_ms / 1e3) if cfg.admission_tpot_ms > 0 else None
        self._gate_mark: tuple[float, int] | None = None  # (start, decodes) of the last step, for the gate
        self.scheduler = Scheduler(self.kv, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   cfg.enable_chunked_prefill, tiers=self.tiers, states=self.state_slots,
                                   pacer=self.pacer, reserve_tokens=cfg.admission_reserve_tokens,
                                   ttft_slo_s=cfg.ttft_slo_ms / 1e3, gate=self.gate)
        self.prefill = PrefillRole(self.kv, self.runner.kv_cache, cfg.kv_transfer_timeout,
                                   weak_method(self._on_step_thread), states=self.runner.states)
        """The prefill side of handoffs (engine/disagg/prefill_side.py); a hybrid model's final part
        carries the request's recurrent state."""
        self.decode = DecodeRole(DecodeTransfers(self.kv, weak_method(self.write_blocks), cfg.kv_transfer_timeout,
                                                 cfg.kv_transfer_timeout, cfg.kv_transfer_reserve_tokens,
                                                 slot_nbytes(self.runner.states) if hybrid else 0),
                                 weak_method(self._on_step_thread))
        """The decode side of handoffs (engine/disagg/decode_side.py)."""
        self.wake: Callable[[], None] | None = None
        """Set by the thread that drives the engine: called when work arrives from another thread
        (a transfer command), so an idle driver runs ``idle_tick`` without waiting for a request."""
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

    def write_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Write KV (``[n, layers, 2, block_size, heads, dim]``) into primary blocks outside the
        forward pass: the one way to do so (the tiers' own loads run inside ``KVTiers.flush``).
        Blocks evicted since the last step whose copy to the host tier is still queued are copied
        first, so a block that left the pool is saved before anything can overwrite it."""
        if self.tiers is not None:
            self.tiers.save_evicted()
        scatter_blocks(self.runner.kv_cache, block_ids, data)

    @property
    def waiting_on_transfers(self) -> bool:
        """True while some request waits for a cache-node fetch (a step may then schedule nothing)."""
        return self.scheduler.num_deferred > 0

    def map_pools(self) -> list[threading.Thread]:
        """Map the host-memory KV pools' pages (the KV cache on CPU, the host tier) on background
        threads, so no step pays a page fault for a block's first write (engine/util/prefault.py).

        A server calls it once at start-up: its pools are its own for the process's life, and
        committing them then also makes a pool too large for the container fail at once rather
        than under load. Offline use does not: an `LLM` touches only what it uses.
        """
        pools = [(self.runner.kv_cache, "KV pool")]
        if self.tiers is not None and self.tiers.host is not None:
            pools.append((self.tiers.host.data, "host KV tier"))
        return [populate_in_background(t, what) for t, what in pools]

    def close(self) -> None:
        """Release the cache-node connections (if any) and the grammar worker. Idempotent."""
        self.runner.grammar_masks.close()
        if self._cache_node is not None:
            self._cache_node.close()
            self._cache_node = None

    # ---- thread-safe entry points -------------------------------------------
    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """Everything add_request checks, without enqueuing; returns the prompt as a list of ints.

        Raises InvalidSamplingParams, InvalidGrammarError, InvalidPromptError (EmptyPromptError
        for no tokens) or PromptTooLongError. A structured output's grammar is compiled here, in
        the caller's thread. A request that passes can always be scheduled to completion.
        """
        params.validate()
        vocab = self.model_config.vocab_size
        ids = _check_token_ids(prompt_token_ids, vocab)
        named = params.token_ids_named()
        if named and max(named) >= vocab:
            bad = next(t for t in named if t >= vocab)
            raise InvalidSamplingParams(f"token id {bad} (in stop_token_ids, logit_bias, allowed_token_ids or "
                                        f"bad_words) is outside this model's vocabulary [0, {vocab})")
        if params.structured is not None:
            self.grammars.prepare(params.structured)  # InvalidGrammarError; cached for add_request
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
                    priority: int = 0, arrival_time: float | None = None,
                    handoff: Handoff | None = None, cache_salt: str | None = None,
                    state_hints: Sequence[int] = ()) -> None:
        """Validate (see check_request) and enqueue; the request joins at the next step.

        ``cache_salt``: the request shares cached KV only with requests of the same salt (its
        chain starts from ``block_hash.chain_root(cache_salt)``; None or "" is the shared root).
        ``state_hints``: hybrid models, prompt positions worth a checkpoint (``Request.state_hints``).

        ``handoff`` (engine/roles.py): a ``PrefillHandoff`` ends the request after its first token
        with a ``KVHandoff`` output (call ``prefill.release`` once it was delivered); a
        ``DecodeClaim`` starts it from a completed transfer.
        """
        ids = self.check_request(prompt_token_ids, params)
        gen = None
        if params.seed is not None and not params.greedy:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed)
        prefill = handoff if isinstance(handoff, PrefillHandoff) else None
        req = Request(
            request_id=request_id,
            prompt_token_ids=ids,
            params=params,
            metrics=RequestMetrics(arrival_time=arrival_time if arrival_time is not None else time.monotonic()),
            priority=priority,
            arrival_seq=next(self._arrival),
            generator=gen,
            handoff=prefill,
            handoff_sent=prefill.from_block if prefill else 0,
            kv_root=chain_root(cache_salt),
            state_hints=tuple(state_hints),
            grammar=GrammarState(self.grammars.matcher(params.structured)) if params.structured else None,
            prompt_logprobs=[] if params.prompt_logprobs is not None else None,
        )
        req.stream = RequestStream(self.tokenizer, req.prompt_token_ids, params)
        with self._lock:
            if request_id in self._live_ids:
                raise DuplicateRequestError(f"request id {request_id!r} is already in flight")
            self._live_ids.add(request_id)
        self._commands.put(Claim(req, handoff) if isinstance(handoff, DecodeClaim) else Add(req))

    def abort_request(self, request_id: str) -> None:
        self._commands.put(Abort(request_id))

    # ---- prefill/decode handoffs (thread-safe; run at the next step or idle tick) --------------
    def _on_step_thread(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` at the next step or idle tick (the thread that owns the KV state); the
        future gives its result, or its ``HandoffError``. The roles post their calls here."""
        fut: Future = Future()
        self._commands.put(Call(fn, fut))
        if self.wake is not None:
            self.wake()
        return fut

    def has_pending_commands(self) -> bool:
        return not self._commands.empty()

    def has_timers(self) -> bool:
        """Transfers or held blocks that expire unless something happens (an idle driver ticks)."""
        return bool(len(self.decode) or len(self.prefill))

    def idle_tick(self) -> list[RequestOutput]:
        """Run commands and expiries without a forward pass (a driver with no requests calls it)."""
        outputs: list[RequestOutput] = []
        self._drain_commands(outputs)
        self._expire(time.monotonic())
        return outputs

    def _expire(self, now: float) -> None:
        for t in self.decode.expire(now):
            log.warning("KV transfer %s expired on the decode side; its blocks were freed", t)
        for rid in self.prefill.expire(now):
            log.warning("handoff of %s was not confirmed in time; its blocks were freed", rid)

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self._live_ids)

    # ---- the step -------------------------------------------------------------
    def _drain_commands(self, outputs: list[RequestOutput]) -> None:
        while True:
            try:
                cmd: StepCommand = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, Add):
                self._requests[cmd.request.request_id] = cmd.request
                self._prompt_tokens += cmd.request.num_prompt_tokens
                self.scheduler.add(cmd.request)
            elif isinstance(cmd, Call):
                self._run_call(cmd.fn, cmd.future)
            elif isinstance(cmd, Claim):
                self._claim(cmd.request, cmd.claim, outputs)
            else:
                req = self._requests.get(cmd.request_id)
                if req is not None and not req.is_finished:
                    self.scheduler.finish(req, "abort")
                    outputs.append(self._finish_output(req))

    @staticmethod
    def _run_call(fn: Callable[[], Any], fut: Future) -> None:
        """Run one step-thread call; whatever it raises fails that call's future alone (the caller
        answers its peer), never the step, so one bad message cannot stop the engine."""
        if not fut.set_running_or_notify_cancel():
            return
        try:
            result = fn()
        except HandoffError as e:
            fut.set_exception(e)
        except Exception as e:  # noqa: BLE001 - a bug or an unchecked input: that call fails, the engine runs on
            log.warning("a KV transfer call failed on the step thread", exc_info=True)
            fut.set_exception(e)
        else:
            fut.set_result(result)

    def _claim(self, req: Request, claim: DecodeClaim, outputs: list[RequestOutput]) -> None:
        """Start a request from a completed transfer: its KV and first token are here already."""
        now = time.monotonic()
        try:
            lp = self.decode.claim(req, claim, now)
        except HandoffError:
            req.status = RequestStatus.FINISHED
            req.finish_reason = "abort"
            outputs.append(self._finish_output(req))
            return
        self._requests[req.request_id] = req
        self._prompt_tokens += req.num_prompt_tokens
        self._generation_tokens += 1
        out = req.stream.on_token(req, req.output_token_ids[-1], lp, self.max_model_len)
        outputs.append(out)
        if out.finished:
            req.status = RequestStatus.FINISHED
            req.finish_reason = out.finish_reason
            self.kv.free(req.request_id)
            self._forget(req, now)
        else:
            self.scheduler.add_transferred(req)

    def _forget(self, req: Request, now: float) -> None:
        req.metrics.finished_time = now
        self._requests.pop(req.request_id, None)
        self.runner.logits_processor.release(req.request_id)
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
        started = time.monotonic()
        if self.gate is not None and self._gate_mark is not None:
            # What the last step's streams waited for their next token: its whole step (scheduling,
            # the forward pass, sampling, outputs) and anything between it and this one.
            self.gate.observe(self._gate_mark[1], started - self._gate_mark[0])
            self._gate_mark = None
        self._drain_commands(outputs)
        if self.has_timers():
            self._expire(time.monotonic())
        self._write_states()  # before scheduling: an admission may reuse a published entry
        sched = self.scheduler.schedule(time.monotonic())
        if self.tiers is not None:
            self.tiers.flush()  # lower-tier saves and loads land before the forward pass
        if sched.is_empty:
            return outputs
        self._num_steps += 1
        self._gate_mark = (started, sched.num_decodes)
        now = time.monotonic()
        for s in sched.seqs:
            if s.request.metrics.first_scheduled_time is None:
                s.request.metrics.first_scheduled_time = now
        block_ids = [self.kv.block_ids(s.request.request_id) for s in sched.seqs]
        plan = self._state_plan(sched)
        self._load_handoff_states(sched)
        try:
            t_exec = time.perf_counter()
            result = self.runner.execute(sched, block_ids, plan)
            if self.pacer is not None:
                self.pacer.observe(sched.num_decodes, sched.num_batched_tokens - sched.num_decodes,
                                   time.perf_counter() - t_exec)
        except Exception as exc:  # noqa: BLE001 - which request caused it is unknown: fail the batch
            if plan is not None:
                self.state_slots.abort(plan)
            return outputs + self._fail([s.request for s in sched.seqs], exc)
        if plan is not None:  # before any request finishes: a finish publishes what this step wrote
            self.state_slots.commit(plan)
        full = self.scheduler.update_after_step(sched)
        if self.tiers is not None:
            saved = self.tiers.after_step(full)
            if saved is not None:
                self.prefill.track_saves([seg.request_id for seg in full if (r := self._requests.get(seg.request_id))
                                          is not None and r.handoff is not None], saved)
        for s in sched.seqs:
            req = s.request
            if req.handoff is not None and req.handoff.stream and not s.produces_token:
                part = self.prefill.stream_part(req)
                if part is not None:
                    outputs.append(RequestOutput(req.request_id, req.prompt_token_ids, [], [], "", "", False, None,
                                                 max(0, req.num_cached_tokens), None, req.metrics, handoff=part))
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
                if req.handoff is not None:
                    slot = self.state_slots.slot(req.request_id) if self.state_slots is not None else None
                    handoff = self.prefill.hand_off(req, tok, lp, now, slot)
                    self.scheduler.finish(req, "transfer", keep_kv=True)
                    self._forget(req, now)
                    outputs.append(RequestOutput(req.request_id, req.prompt_token_ids, [tok], [tok], "", "", True,
                                                 "transfer", max(0, req.num_cached_tokens), [lp] if lp else None,
                                                 req.metrics, handoff=handoff))
                    continue
                try:
                    out = req.stream.on_token(req, tok, lp, self.max_model_len)
                except Exception as exc:  # noqa: BLE001 - e.g. a detokenizer error: this request only
                    outputs.extend(self._fail([req], exc))
                    continue
                if out.finished:
                    self.scheduler.finish(req, out.finish_reason)
                    self._forget(req, now)
                outputs.append(out)
        self._write_states()  # a finished turn's checkpoint reaches the node now, not next step
        if self.debug_checks:
            self.check_integrity()
        return outputs

    def _write_states(self) -> None:
        """Hybrid with a cache node: write the checkpoints published since the last call through."""
        if self.state_slots is None or not self.state_slots.write_through:
            return
        published = self.state_slots.take_published()
        if published:
            pool = self.runner.states
            self.tiers.remote.save_states(pool.ckpt_conv, pool.ckpt_ssm, [i for i, _ in published],
                                          [h for _, h in published])

    def _state_plan(self, sched) -> StepStatePlan | None:
        """Hybrid models: the step's slots, checkpoint restores and captures; the host checkpoint
        tier's saves and loads land here, before the runner restores entries into slots."""
        if self.state_slots is None:
            return None
        seqs = [(s.request.request_id, s.request.all_token_ids, s.request.kv_root, s.request.num_prompt_tokens,
                 s.num_computed_tokens, s.num_new_tokens, s.request.state_hints) for s in sched.seqs]
        plan = self.state_slots.plan(seqs, lambda rid, toks, root, n: self.kv.extend_chain(rid, toks, n, root))
        self.state_slots.flush(self.runner.states.ckpt_conv, self.runner.states.ckpt_ssm)
        return plan

    def _load_handoff_states(self, sched) -> None:
        """Hybrid decode role: write each newly admitted transferred request's recurrent state (the
        prefill engine's, at the prompt's end) into its slot before the forward reads it."""
        if self.state_slots is None:
            return
        for s in sched.seqs:
            req = s.request
            if req.handoff_state is not None:
                scatter_state(self.runner.states, self.state_slots.slot(req.request_id), req.handoff_state)
                req.handoff_state = None

    def check_integrity(self) -> None:
        """KV manager and lower-tier invariants (O(blocks); tests and debug runs)."""
        self.kv.check_integrity()
        self.decode.check_integrity()
        if self.state_slots is not None:
            self.state_slots.check_integrity()
            held = {r.request_id for r in self.scheduler.running}
            owners = self.state_slots.owners()
            assert owners == held, f"state slots held by {sorted(owners)}, running {sorted(held)}"
        if self.tiers is not None:
            self.tiers.check_integrity()
        leaked = set(self.runner.logits_processor.table.rows) - set(self._requests)
        assert not leaked, f"penalty rows held by finished requests: {sorted(leaked)}"

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
            kv_transfers_reserved=len(self.decode),
            kv_transfer_blocks_reserved=self.decode.reserved_blocks,
            kv_handoffs_held=len(self.prefill),
            kv_transfer_timeouts=self.decode.timeouts + self.prefill.timeouts,
            state_checkpoints=self.state_slots.stats() if self.state_slots is not None else None,
            state_tiers=tuple(self.state_slots.snapshots(self.tiers.remote if self.tiers is not None else None))
            if self.state_slots is not None else (),
        )
