"""Continuous batching under a per-step token budget with chunked prefill and
preemption by recompute.

Each step: running requests first (decodes and unfinished prefill chunks, in
priority order), then waiting requests while budget, sequence slots and KV
blocks last. When a running request cannot get a block, the lowest-priority,
latest-arrived running request is preempted (its blocks freed, its progress
reset so it is recomputed later, its generated tokens kept). No new request is
admitted in a step that preempted.

With chunked prefill off, a new request is admitted only when its whole prompt
fits in the step's remaining budget (the engine rejects prompts longer than the
budget, so the head of the queue always fits once the running requests finish).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from kvmesh.engine.kv.kv_manager import KVCacheManager
from kvmesh.engine.request import Request, RequestStatus


@dataclass
class ScheduledSeq:
    request: Request
    num_new_tokens: int
    num_computed_tokens: int  # before this step

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
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.running: list[Request] = []
        self._waiting: list[tuple[int, int, Request]] = []  # heap on Request.sort_key()
        self._num_waiting = 0
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
        for _, _, req in self._waiting:
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

    def finish(self, req: Request, reason: str) -> None:
        """Remove a request (running or waiting) and free its KV blocks at once."""
        if req.status is RequestStatus.FINISHED:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self._num_waiting -= 1  # lazily dropped from the heap when it surfaces
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.kv.free(req.request_id)

    def _peek_waiting(self) -> Request | None:
        while self._waiting and self._waiting[0][2].status is not RequestStatus.WAITING:
            heapq.heappop(self._waiting)
        return self._waiting[0][2] if self._waiting else None

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.add(req)

    # ---- one step ---------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        self.running.sort(key=Request.sort_key)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            preempted_self = False
            while self.kv.allocate_slots(req.request_id, req.all_token_ids, num_new,
                                         num_computed_tokens=req.num_computed_tokens) is None:
                victim = self.running.pop()
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
            i += 1

        if not out.preempted:
            while budget > 0 and len(self.running) < self.max_num_seqs:
                req = self._peek_waiting()
                if req is None:
                    break
                computed_blocks, num_computed = self.kv.get_computed_blocks(req.request_id, req.all_token_ids)
                num_new = req.num_tokens - num_computed
                # A preempted request is recomputed in chunks even with chunked prefill off: its
                # prompt plus generated tokens may exceed the budget, and the engine only
                # guarantees that the prompt alone fits in one step.
                if num_new > budget and not self.enable_chunked_prefill and not req.output_token_ids:
                    break
                num_new = min(num_new, budget)
                blocks = self.kv.allocate_slots(
                    req.request_id, req.all_token_ids, num_new, computed_blocks, num_computed
                )
                if blocks is None:
                    break
                heapq.heappop(self._waiting)
                self._num_waiting -= 1
                req.status = RequestStatus.RUNNING
                req.num_computed_tokens = num_computed
                first_admission = req.num_cached_tokens < 0
                if first_admission:
                    req.num_cached_tokens = min(num_computed, req.num_prompt_tokens)
                self.kv.record_prefix_lookup(req.num_tokens, num_computed, preempted=not first_admission)
                self.running.append(req)
                scheduled.append(ScheduledSeq(req, num_new, num_computed))
                budget -= num_new

        decodes = [s for s in scheduled if s.num_new_tokens == 1]
        others = [s for s in scheduled if s.num_new_tokens != 1]
        out.seqs = decodes + others
        out.num_decodes = len(decodes)
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        return out

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance computed-token counts and publish newly full blocks to the prefix cache.

        Call after the forward pass and before appending sampled tokens.
        """
        for s in out.seqs:
            req = s.request
            req.num_computed_tokens = s.num_computed_tokens + s.num_new_tokens
            self.kv.cache_blocks(req.request_id, req.all_token_ids, req.num_computed_tokens)
