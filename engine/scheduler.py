"""Continuous batching under a per-step token budget with chunked prefill and
preemption by recompute.

Each step: running requests first (decodes and unfinished prefill chunks, in
priority order), then waiting requests while budget, sequence slots and KV
blocks last. When a running request cannot get a block, the lowest-priority,
latest-arrived running request is preempted (its blocks freed, its progress
reset so it is recomputed later, its generated tokens kept). No new request is
admitted in a step that preempted.

With an admission reserve of N tokens (``reserve_tokens``), a waiting request is admitted
only if the pool keeps, after its blocks, the blocks every running request and the new one
need for their next N tokens (the rest of a prompt being prefilled counts; no request counts
past its max_tokens, a prefill-role request past its first token). Invariant: while every
running request stays within N tokens of where it was at the last admission, no running
request is preempted to make room for a new one; a pool that would have thrashed instead
queues new requests until running ones finish. With nothing running, the head of the queue
is admitted whenever its blocks fit, so the reserve never stalls an idle engine.

With a TTFT target (``ttft_slo_s``, ``--ttft-slo-ms``), waiting requests that have already
waited longer than it for a first token are admitted after those that have not (each class in
queue order). Under overload the queue then serves the requests that can still make the target
instead of spending the engine on ones that cannot; a late request still runs whenever no timely
one waits (the scheduler never idles for it), and waits longer than it would have.

With chunked prefill off, a new request is admitted only when its whole prompt
fits in the step's remaining budget (the engine rejects prompts longer than the
budget, so the head of the queue always fits once the running requests finish).

With lower KV tiers (``kv.tiers.KVTiers``), an admission also loads the chain's blocks
found in the host tier or on a cache node into freshly allocated blocks. A request
whose cache-node fetch is in flight is set aside (still waiting, out of the queue)
and rejoins the queue, in its old place, once the fetch is done; the step never
waits on the network.

A prefill-role request whose KV streams to its decode engine chunk by chunk
(``PrefillHandoff.tail_tokens``) has its last chunk cut short (``chunk_tokens``): every block
before the tail is computed, and pushed, one step before the first token, so what is left to
push after it is the tail alone.

With a ``TpotGate`` (``--admission-tpot-ms``, engine/tpot_gate.py), waiting requests are admitted
one per step while others run, and not at all while the recent steps that carried decodes averaged
at or above its target; transferred requests (below) are not gated.

With a ``PrefillPacer`` (``--tpot-slo-ms``) and chunked prefill, the prompt tokens of a step that
carries decodes are cut to what the decoding streams' TPOT slack allows (at least the pacer's
floor, so every prompt advances); the engine passes the step's start time to ``schedule``.

A transferred request (decode role: its prompt's KV arrived from a prefill engine, with every
block it will need reserved) joins through ``add_transferred``: it is admitted before waiting
requests, as one decode token, and never picked as a preemption victim while another running
request can be.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from kvmesh.engine.kv.kv_manager import CachedSegment, KVCacheManager
from kvmesh.engine.kv.hybrid_state import HybridStateManager
from kvmesh.engine.kv.tiers import KVTiers
from kvmesh.engine.prefill_pacer import PrefillPacer
from kvmesh.engine.request import Request, RequestStatus
from kvmesh.engine.tpot_gate import TpotGate


def chunk_tokens(computed: int, total: int, budget: int, block_size: int = 1, tail: int = 0) -> int:
    """Tokens to compute this step for a sequence at ``computed`` of ``total`` known tokens.

    ``min(total - computed, budget)``, except that with ``tail`` > 0 a chunk that would reach the
    end stops at the last block boundary at or before ``total - tail``, when at least ``tail``
    tokens come before it (a smaller piece is not worth a step of its own): the final step then
    computes fewer than ``tail + block_size`` tokens. At least 1 when anything is left."""
    n = min(total - computed, budget)
    if tail > 0 and computed + n == total:
        cut = (total - tail) // block_size * block_size
        if cut - computed >= tail:
            return cut - computed
    return n


@dataclass
class ScheduledSeq:
    request: Request
    num_new_tokens: int
    num_computed_tokens: int  # before this step
    num_cached_new: int = 0
    """The first this many new tokens already have their KV in the request's cached blocks (a hit
    on a whole block-aligned prompt, for its last token): they are computed for their logits only,
    and the runner sends their KV writes to its scratch block, so a shared block never changes."""

    @property
    def produces_token(self) -> bool:
        """True when this chunk reaches the end of the known tokens, so its logits are sampled."""
        return self.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    """Sequences to run this step, decodes (one new token) first."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    num_decodes: int = 0
    num_batched_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        tiers: KVTiers | None = None,
        states: HybridStateManager | None = None,
        pacer: PrefillPacer | None = None,
        reserve_tokens: int = 0,
        ttft_slo_s: float = 0.0,
        gate: TpotGate | None = None,
    ) -> None:
        if reserve_tokens < 0:
            raise ValueError(f"reserve_tokens must be >= 0, got {reserve_tokens}")
        if not ttft_slo_s >= 0:
            raise ValueError(f"ttft_slo_s must be >= 0 (0: first come, first served), got {ttft_slo_s}")
        self.kv = kv
        self.reserve_tokens = reserve_tokens
        self.ttft_slo_s = ttft_slo_s
        self.gate = gate
        self.pacer = pacer if enable_chunked_prefill else None
        self.tiers = tiers
        # Hybrid models: a running request holds a recurrent-state slot (admission to finish or
        # preemption); there are max_num_seqs slots, so a slot is always free to admit. A prefix
        # hit is cut back to the last boundary with a state checkpoint, restored at admission.
        self.states = states
        self._deferred: list[Request] = []  # waiting on a cache-node fetch, out of the heap
        self._transferred: list[Request] = []  # KV received, blocks held: admitted first
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.running: list[Request] = []
        self._waiting: list[tuple[int, int, Request]] = []  # heap on Request.sort_key()
        self._num_waiting = 0
        self._late: list[tuple[int, int, Request]] = []  # waiting past the TTFT target, same order
        self.num_preemptions = 0

    # ---- queue management -------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def queued_prefill_tokens(self) -> int:
        """Prompt tokens not yet computed, over waiting and partly prefilled running requests."""
        n = 0
        for req in [r for _, _, r in self._waiting + self._late] + self._deferred:
            if req.status is RequestStatus.WAITING:
                n += max(0, req.num_prompt_tokens - req.num_computed_tokens)
        for req in self.running:
            n += max(0, req.num_prompt_tokens - req.num_computed_tokens)
        return n

    def has_unfinished(self) -> bool:
        return bool(self.running) or self._num_waiting > 0

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        heapq.heappush(self._waiting, (*req.sort_key(), req))
        self._num_waiting += 1

    def add_transferred(self, req: Request) -> None:
        """A request whose KV arrived by transfer (it already holds all its blocks)."""
        req.status = RequestStatus.WAITING
        req.transferred = True
        self._transferred.append(req)
        self._num_waiting += 1

    def finish(self, req: Request, reason: str, keep_kv: bool = False) -> None:
        """Remove a request (running or waiting) and free its KV blocks at once (unless
        ``keep_kv``: a prefill handoff keeps them until the decode side confirms)."""
        if req.status is RequestStatus.FINISHED:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self._num_waiting -= 1  # lazily dropped from the heap when it surfaces
            if req.transferred and req in self._transferred:
                self._transferred.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if not keep_kv:
            self.kv.free(req.request_id)
        if self.states is not None:
            self.states.free(req.request_id)
        if self.tiers is not None:
            self.tiers.forget(req.request_id)

    def _peek_waiting(self, now: float | None = None) -> Request | None:
        """The next request to admit: the first in queue order that can still make the TTFT
        target, else the first of those that cannot (moved aside as they are found late)."""
        while self._waiting:
            req = self._waiting[0][2]
            if req.status is not RequestStatus.WAITING:
                heapq.heappop(self._waiting)
            elif self._is_late(req, now):
                heapq.heappush(self._late, heapq.heappop(self._waiting))
            else:
                return req
        while self._late and self._late[0][2].status is not RequestStatus.WAITING:
            heapq.heappop(self._late)
        return self._late[0][2] if self._late else None

    def _is_late(self, req: Request, now: float | None) -> bool:
        """Waiting longer than the TTFT target for a first token (a preempted request, which has
        its first token, never is)."""
        return (self.ttft_slo_s > 0 and now is not None and not req.output_token_ids
                and now - req.metrics.arrival_time > self.ttft_slo_s)

    def _pop_waiting(self, req: Request) -> None:
        heap = self._waiting if self._waiting and self._waiting[0][2] is req else self._late
        heapq.heappop(heap)

    @property
    def num_deferred(self) -> int:
        """Waiting requests whose cache-node fetch is in flight."""
        return len(self._deferred)

    def _requeue_deferred(self) -> None:
        """Put set-aside requests whose fetch finished back into the queue (finished ones go)."""
        keep = []
        for req in self._deferred:
            if req.status is not RequestStatus.WAITING:
                continue
            if self.tiers is not None and self.tiers.is_deferred(req.request_id):
                keep.append(req)
            else:
                heapq.heappush(self._waiting, (*req.sort_key(), req))
        self._deferred = keep

    def _pop_victim(self, req: Request) -> Request:
        """The latest-sorted running request, skipping transferred ones while another (or
        ``req`` itself) can go: a transferred request was admitted with all its blocks."""
        for i in range(len(self.running) - 1, -1, -1):
            cand = self.running[i]
            if not cand.transferred or cand is req:
                return self.running.pop(i)
        return self.running.pop()

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.request_id)
        if self.states is not None:  # the state is lost with the slot: recomputed from token 0
            self.states.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.add(req)

    # ---- one step ---------------------------------------------------------
    def schedule(self, now: float | None = None) -> SchedulerOutput:
        """The next step's sequences. ``now`` (the engine's monotonic clock) enables pacing."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        if self._deferred:
            self._requeue_deferred()
        self.running.sort(key=Request.sort_key)
        prefill_left = self._prefill_cap(now)  # prompt tokens this step may add (None: no cap)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            chunk_budget = budget
            prefilling = req.num_tokens - req.num_computed_tokens > 1
            if prefill_left is not None and prefilling:
                if prefill_left <= 0:  # paced: this prompt waits a step; the decodes go on
                    i += 1
                    continue
                chunk_budget = min(budget, prefill_left)
            num_new = chunk_tokens(req.num_computed_tokens, req.num_tokens, chunk_budget, self.kv.block_size,
                                   self._tail(req))
            preempted_self = False
            while self.kv.allocate_slots(req.request_id, req.all_token_ids, num_new,
                                         num_computed_tokens=req.num_computed_tokens, root=req.kv_root) is None:
                victim = self._pop_victim(req)
                victim.status = RequestStatus.WAITING
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    preempted_self = True
                    break
            if preempted_self:
                break
            scheduled.append(ScheduledSeq(req, num_new, req.num_computed_tokens))
            budget -= num_new
            if prefill_left is not None and prefilling:
                prefill_left -= num_new
            i += 1

        if not out.preempted:
            while self._transferred and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self._transferred.pop(0)
                num_new = req.num_tokens - req.num_computed_tokens
                if self.kv.allocate_slots(req.request_id, req.all_token_ids, num_new,
                                          num_computed_tokens=req.num_computed_tokens, root=req.kv_root) is None:
                    self._transferred.insert(0, req)  # cannot happen with a full reservation; wait
                    break
                self._num_waiting -= 1
                req.status = RequestStatus.RUNNING
                if self.states is not None:
                    self.states.allocate(req.request_id)
                self.running.append(req)
                scheduled.append(ScheduledSeq(req, num_new, req.num_computed_tokens))
                budget -= num_new
            # Only a queue to admit from needs the running requests' reserve.
            reserve = (sum(self._reserve_blocks(r, self.kv.num_held_blocks(r.request_id)) for r in self.running)
                       if self.reserve_tokens and self._num_waiting else 0)
            admitted = 0
            # A hybrid model resumes from a recurrent state at a checkpoint, never one token short
            # of the prompt's end: its hits leave the last token to compute, as before.
            whole = self.states is None
            while (budget > 0 and len(self.running) < self.max_num_seqs
                   and (prefill_left is None or prefill_left > 0)
                   and (self.gate is None or self.gate.admits(len(self.running), admitted))):
                req = self._peek_waiting(now)
                if req is None:
                    break
                if req.collects_prompt_logprobs:  # every prompt position's logits are computed
                    computed_blocks, num_computed = [], 0
                else:
                    computed_blocks, num_computed = self.kv.get_computed_blocks(req.request_id, req.all_token_ids,
                                                                                req.kv_root, whole=whole)
                hits = None
                if self.tiers is not None and self.kv.enable_caching and not req.collects_prompt_logprobs:
                    hits = self.tiers.lookup(req.request_id, req.num_tokens, len(computed_blocks), whole=whole)
                    if hits is None:  # a cache-node fetch is in flight: let the others run
                        self._pop_waiting(req)
                        self._deferred.append(req)
                        continue
                restore = None
                if self.states is not None:
                    # Hybrid: the hit ends where a checkpoint exists (device, host or node) within the
                    # KV blocks cached on any tier; the KV past it is recomputed, not loaded.
                    num_kv = len(computed_blocks) + (hits.num_blocks if hits is not None else 0)
                    fetched = hits.state if hits is not None else None
                    keep, restore = (self.states.hit(self.kv.chain(req.request_id), num_kv, fetched) if num_kv
                                     else (0, None))
                    if keep < len(computed_blocks):
                        computed_blocks, num_computed = computed_blocks[:keep], keep * self.kv.block_size
                    if hits is not None:
                        self.tiers.trim(hits, keep - len(computed_blocks))
                num_loaded = hits.num_tokens if hits is not None else 0
                # A hit on the whole prompt: its last token is run again for its logits (its KV stays).
                redo = 1 if num_computed + num_loaded == req.num_tokens else 0
                num_new = req.num_tokens - num_computed - num_loaded + redo
                # A preempted request is recomputed in chunks even with chunked prefill off: its
                # prompt plus generated tokens may exceed the budget, and the engine only
                # guarantees that the prompt alone fits in one step.
                if num_new > budget and not self.enable_chunked_prefill and not req.output_token_ids:
                    self._cancel_hits(hits, restore)
                    break
                start = num_computed + num_loaded - redo
                num_new = chunk_tokens(start, req.num_tokens,
                                       budget if prefill_left is None else min(budget, prefill_left),
                                       self.kv.block_size, self._tail(req))
                own = self._reserve_blocks(req, self.kv.num_blocks_for(start + num_new))
                blocks = self.kv.allocate_slots(
                    req.request_id, req.all_token_ids, num_new - redo, computed_blocks, num_computed + num_loaded,
                    root=req.kv_root, spare_blocks=reserve + own if self.running else 0,
                )
                if blocks is None:
                    self._cancel_hits(hits, restore)
                    break
                if self.tiers is not None and hits is not None:
                    self.tiers.commit(req.request_id, hits, blocks, len(computed_blocks))
                    if num_loaded:  # loaded blocks join the primary prefix index now (promotion)
                        self.kv.cache_blocks(req.request_id, req.all_token_ids, num_computed + num_loaded)
                self._pop_waiting(req)
                self._num_waiting -= 1
                req.status = RequestStatus.RUNNING
                if self.states is not None:
                    self.states.allocate(req.request_id, restore)
                req.num_computed_tokens = start
                first_admission = req.num_cached_tokens < 0
                if first_admission:
                    req.num_cached_tokens = min(start, req.num_prompt_tokens)
                # The primary tier's own counters: hits there only (lower tiers count their own).
                self.kv.record_prefix_lookup(req.num_tokens, min(num_computed, start), preempted=not first_admission)
                self.running.append(req)
                admitted += 1
                reserve += own
                scheduled.append(ScheduledSeq(req, num_new, start, num_cached_new=redo))
                budget -= num_new
                if prefill_left is not None:
                    prefill_left -= num_new

        decodes = [s for s in scheduled if s.num_new_tokens == 1]
        others = [s for s in scheduled if s.num_new_tokens != 1]
        out.seqs = decodes + others
        out.num_decodes = len(decodes)
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        return out

    def _reserve_blocks(self, req: Request, held_blocks: int) -> int:
        """Blocks past ``held_blocks`` that ``req`` needs for its next ``reserve_tokens`` tokens."""
        if self.reserve_tokens <= 0:
            return 0
        end = req.num_prompt_tokens + (1 if req.handoff is not None else req.params.max_tokens)
        horizon = min(end, req.num_tokens + self.reserve_tokens)
        return max(0, self.kv.num_blocks_for(horizon) - held_blocks)

    def _prefill_cap(self, now: float | None) -> int | None:
        """The pacer's prompt-token allowance beside the running decodes (None: no pacing)."""
        if self.pacer is None or now is None:
            return None
        streams = [(r.metrics.first_token_time, len(r.output_token_ids)) for r in self.running
                   if r.output_token_ids and r.metrics.first_token_time is not None
                   and r.num_computed_tokens == r.num_tokens - 1]
        return self.pacer.budget(now, streams) if streams else None

    def _tail(self, req: Request) -> int:
        h = req.handoff
        return h.tail_tokens if h is not None and h.stream and self.enable_chunked_prefill else 0

    def _cancel_hits(self, hits, restore: int | None) -> None:
        """An admission that found hits did not happen: give back what its lookups reserved."""
        if self.tiers is not None:
            self.tiers.cancel(hits)
        if self.states is not None:
            self.states.cancel(restore)

    def update_after_step(self, out: SchedulerOutput) -> list[CachedSegment]:
        """Advance computed-token counts and publish newly full blocks to the prefix cache.

        Call after the forward pass and before appending sampled tokens. Returns the blocks
        this step's forward made full (for a write-through to a cache node).
        """
        segments: list[CachedSegment] = []
        for s in out.seqs:
            req = s.request
            req.num_computed_tokens = s.num_computed_tokens + s.num_new_tokens
            seg = self.kv.cache_blocks(req.request_id, req.all_token_ids, req.num_computed_tokens)
            if seg is not None:
                segments.append(seg)
        return segments
