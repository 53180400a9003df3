"""Recurrent state of a hybrid model's requests: slots, checkpoints and what each step does with them.

The scheduler calls ``hit`` / ``allocate`` / ``free`` (admission, finish, preemption); the
engine calls ``plan`` before the forward pass and ``commit`` (or ``abort``) after it. A plan
names, per scheduled sequence, its slot, the checkpoint to restore into that slot before the
forward, and the checkpoint entries the forward writes at block boundaries inside the step
(``checkpoint.capture_points``). Entries written by a step are published only once the
step succeeded.

A prefix hit on a hybrid model is the longest prefix whose attention blocks are all cached
and whose end has a checkpoint: the state there is restored into the request's slot and only
the suffix is computed. Without a checkpoint pool there are no hybrid prefix hits at all.

With a host checkpoint tier (``host_state_tier.HostStateTier``) an entry the device pool evicts
moves down to host memory by hash, and a hit may end at a host checkpoint: the admission
reserves a device entry for it (``hit``), and ``allocate`` promotes it there (the bytes land at
the step's ``flush``, before the runner restores the entry into the request's slot). A
checkpoint hash is in at most one of (device index, host tier).

With a cache node, the admission's fetch may bring one checkpoint (``FetchedState``); a hit may
end there, promoted the same way (its bytes land at the flush). Checkpoints this engine
computes and publishes are queued for write-through (``take_published``).

Checkpoints land where later prompts diverge, not only every ``interval`` tokens: at the token
positions a request names (``plan``'s hints: a chat prompt's message ends, branch points the
router learned) and at this engine's branch points (``state_checkpoints.BranchPoints``: block
ends where a prefix hit was cut back for want of a checkpoint), which ``on_branch`` announces.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvmesh.engine.block_hash import BlockHash
from kvmesh.engine.kv.events import TIER_CPU, TIER_GPU, TIER_REMOTE
from kvmesh.engine.kv.host_state_tier import HostStateTier
from kvmesh.engine.kv.host_tier import TierStats
from kvmesh.engine.kv.remote_tier import RemoteTier
from kvmesh.engine.kv.state_checkpoints import (
    BranchPoints,
    CheckpointIndex,
    CheckpointStats,
    capture_points,
    restorable_blocks,
    wanted_boundaries,
)
from kvmesh.engine.kv.state_wire import FetchedState
from kvmesh.engine.kv.state_slots import StateSlots
from kvmesh.engine.kv.tiers import TierSnapshot

# (request id, all tokens, root, number of blocks) -> the request's first chain hashes
ChainFn = Callable[[str, Sequence[int], bytes, int], list[BlockHash]]


@dataclass
class StepStatePlan:
    """One step's state work. Invariant: len(slots) == len(captures) == number of sequences."""

    slots: list[int]
    restores: list[tuple[int, int]] = field(default_factory=list)  # (checkpoint entry, slot), before the forward
    captures: list[list[tuple[int, int]]] = field(default_factory=list)  # per seq: (tokens into its chunk, entry)
    publish: list[tuple[int, BlockHash]] = field(default_factory=list)
    pending: list[tuple[str, int, BlockHash]] = field(default_factory=list)
    unpin: list[int] = field(default_factory=list)


class HybridStateManager:
    def __init__(self, num_slots: int, block_size: int, checkpoints: CheckpointIndex | None = None,
                 interval: int = 0, host: HostStateTier | None = None,
                 on_branch: Callable[[BlockHash, BlockHash | None], None] | None = None) -> None:
        if interval < 0 or interval % block_size:
            raise ValueError(f"the state checkpoint interval must be a multiple of the block size "
                             f"({block_size}), got {interval}")
        self.slots = StateSlots(num_slots)
        self.checkpoints = checkpoints
        self.block_size = block_size
        self.interval = interval
        self._restores: list[tuple[int, int]] = []  # admitted this step, not yet planned
        self._pending: dict[str, tuple[int, BlockHash]] = {}
        self.host = host if checkpoints is not None else None
        self.branches = BranchPoints()
        self.on_branch = on_branch  # (a new branch point, the one it displaced or None): KV events
        self._promoting: dict[int, BlockHash | FetchedState] = {}  # device entry -> host hash or fetched
        # checkpoint, between hit and allocate/cancel
        self._remote_loads: list[tuple[int, FetchedState]] = []  # (device entry, bytes), until flush
        self.remote_promotions = 0
        self.write_through = False  # set with a cache node: published entries queue for take_published
        self._published: list[tuple[int, BlockHash]] = []
        if self.host is not None:
            notify = checkpoints.on_evict  # the engine's checkpoint events, if any

            def evicted(entry: int, h: BlockHash) -> None:
                self.host.save(entry, h)
                if notify is not None:
                    notify(entry, h)

            checkpoints.on_evict = evicted

    @property
    def caching(self) -> bool:
        """True when prefix hits are possible (there is a checkpoint pool)."""
        return self.checkpoints is not None

    # ---- scheduler side ------------------------------------------------------------------
    def hit(self, hashes: Sequence[BlockHash], num_kv_blocks: int,
            fetched: FetchedState | None = None) -> tuple[int, int | None]:
        """(blocks, entry): the longest prefix of ``num_kv_blocks`` cached KV blocks whose last
        block has a checkpoint, and the device entry to restore; (0, None) when there is none.

        The rule is ``restorable_blocks``' (the router predicts hits with it from the checkpoint
        events of every medium). A checkpoint found in the host tier (or ``fetched`` from the
        cache node) is reserved together with a device entry to promote it into: follow with
        ``allocate`` (the admission happened) or ``cancel``. When no device entry can be
        reserved (every one pinned or being written) the hit looks further down.

        A hit cut back short of ``num_kv_blocks`` makes block ``num_kv_blocks - 1``'s end a
        branch point: the KV match ended there, so the next prompt crossing it checkpoints it."""
        if self.checkpoints is None:
            return 0, None
        j, idx = self._hit(hashes, num_kv_blocks, fetched)
        if j < num_kv_blocks:
            h = hashes[num_kv_blocks - 1]
            new, displaced = self.branches.add(h)
            if new and self.on_branch is not None:
                self.on_branch(h, displaced)
        return j, idx

    def _hit(self, hashes: Sequence[BlockHash], num_kv_blocks: int,
             fetched: FetchedState | None) -> tuple[int, int | None]:
        ck, host = self.checkpoints, self.host
        if host is not None and num_kv_blocks:
            host.stats.queries += 1

        def fetched_at(h: BlockHash) -> bool:
            return fetched is not None and fetched.block_hash == h

        def has(h: BlockHash) -> bool:
            return h in ck or (host is not None and host.has(h)) or fetched_at(h)

        limit = num_kv_blocks
        while (j := restorable_blocks(hashes, limit, has)):
            h = hashes[j - 1]
            idx = ck.lookup(h)
            if idx is not None:
                return j, idx
            if host is not None and host.has(h):
                host.reserve(h)  # first: the reserve below may evict a device entry into the host tier
                idx = ck.reserve()
                if idx is not None:
                    self._promoting[idx] = h
                    return j, idx
                host.release(h)
            elif fetched is not None and fetched.blocks == j:
                idx = ck.reserve()
                if idx is not None:
                    self._promoting[idx] = fetched
                    return j, idx
            limit = j - 1
        return 0, None

    def cancel(self, entry: int | None) -> None:
        """The admission ``hit`` answered did not happen: undo a promotion's reservations."""
        h = self._promoting.pop(entry, None) if entry is not None else None
        if h is not None:
            self.checkpoints.release(entry)
            if not isinstance(h, FetchedState):
                self.host.release(h)

    def allocate(self, request_id: str, restore: int | None = None) -> int:
        """Give an admitted request a slot; ``restore``: the checkpoint entry its hit resumes from
        (pinned until the step that copies it has run)."""
        slot = self.slots.allocate(request_id)
        if restore is not None:
            assert self.checkpoints is not None
            h = self._promoting.pop(restore, None)
            if isinstance(h, FetchedState):  # from the cache node: loaded at the step's flush
                self._remote_loads.append((restore, h))
                self.checkpoints.publish(restore, h.block_hash)
                self.remote_promotions += 1
                if self.host is not None:
                    self.host.discard((h.block_hash,))
            elif h is not None:  # from the host tier: loaded into the entry at the step's flush
                self.host.promote(h, restore)
                self.checkpoints.publish(restore, h)
            self.checkpoints.pin(restore)
            self._restores.append((restore, slot))
            self.checkpoints.stats.restores += 1
        return slot

    def free(self, request_id: str) -> None:
        """The request finished or was preempted: publish the state it kept at its last boundary
        (a restore point for a turn that extends it), then give its slot back."""
        held = self._pending.pop(request_id, None)
        if held is not None and self.checkpoints is not None:
            self._publish(*held)
        self.slots.free(request_id)

    def slot(self, request_id: str) -> int:
        return self.slots.slot(request_id)

    def owners(self) -> set[str]:
        return self.slots.owners()

    # ---- engine side ---------------------------------------------------------------------
    def plan(self, seqs: Sequence[tuple[str, Sequence[int], bytes, int, int, int, Sequence[int]]],
             chain: ChainFn) -> StepStatePlan:
        """``seqs``: per scheduled sequence (request id, all tokens, chain root, prompt length,
        tokens computed before the step, tokens this step, prompt positions worth a checkpoint)."""
        plan = StepStatePlan(slots=[self.slots.slot(s[0]) for s in seqs], restores=self._restores)
        plan.unpin = [idx for idx, _ in self._restores]
        self._restores = []
        ck = self.checkpoints
        bs = self.block_size
        for rid, tokens, root, num_prompt, start, n, hints in seqs:
            caps: list[tuple[int, int]] = []
            plan.captures.append(caps)
            if ck is None:
                continue
            wanted: set[int] = set()
            upto = min(start + n, num_prompt)  # branch points and hints lie in the prompt
            if upto // bs > start // bs and (hints or len(self.branches)):
                wanted = wanted_boundaries(chain(rid, tokens, root, upto // bs), start, upto, bs,
                                           self.branches, hints)
            published, pending = capture_points(start, start + n, num_prompt, bs, self.interval, wanted)
            points = published + ([pending] if pending is not None else [])
            if not points:
                continue
            hashes = chain(rid, tokens, root, max(points) // self.block_size)
            for b in published:
                h = hashes[b // self.block_size - 1]
                if h in ck:
                    ck.lookup(h)  # already held (e.g. recomputed after preemption): refresh only
                    continue
                idx = ck.reserve()
                if idx is not None:
                    caps.append((b - start, idx))
                    plan.publish.append((idx, h))
            if pending is not None:
                idx = ck.reserve()
                if idx is not None:
                    caps.append((pending - start, idx))
                    plan.pending.append((rid, idx, hashes[pending // self.block_size - 1]))
            elif any(b > (num_prompt - 1) // self.block_size * self.block_size for b in published):
                old = self._pending.pop(rid, None)  # superseded by a published point past it
                if old is not None:
                    ck.release(old[0])
            caps.sort()
        return plan

    def commit(self, plan: StepStatePlan) -> None:
        """The step ran: its captures hold valid state; publish them, keep the pending ones."""
        ck = self.checkpoints
        for idx in plan.unpin:
            ck.unpin(idx)
        for idx, h in plan.publish:
            self._publish(idx, h)
        for rid, idx, h in plan.pending:
            old = self._pending.get(rid)
            if old is not None:
                ck.release(old[0])
            self._pending[rid] = (idx, h)

    def _publish(self, idx: int, h: BlockHash) -> None:
        """Publish a state this engine computed (queued for write-through when there is a node)."""
        if self.write_through and h not in self.checkpoints:
            self._published.append((idx, h))
        self.checkpoints.publish(idx, h)
        if self.host is not None:
            self.host.discard((h,))  # recomputed while the host tier held it: one copy, on the device

    def flush(self, ckpt_conv, ckpt_ssm) -> None:
        """Move the host tier's pending saves and loads (``StatePool.ckpt_*``); call after ``plan``
        and before the forward pass and its restores."""
        if self.host is not None:
            self.host.flush(ckpt_conv, ckpt_ssm)
        loads, self._remote_loads = self._remote_loads, []
        if loads:
            ids = torch.tensor([e for e, _ in loads], dtype=torch.int64, device=ckpt_conv.device)
            dev = ckpt_conv.device
            ckpt_conv.index_copy_(1, ids, torch.stack([f.conv for _, f in loads], 1).to(dev))
            ckpt_ssm.index_copy_(1, ids, torch.stack([f.ssm for _, f in loads], 1).to(dev))

    def take_published(self) -> list[tuple[int, BlockHash]]:
        """(entry, hash) published since the last call and still held there, for write-through;
        call before anything may reserve entries again (the next plan or admission)."""
        out, self._published = self._published, []
        ck = self.checkpoints
        return [(i, h) for i, h in out if ck is not None and ck.lookup_entry(h) == i]

    def abort(self, plan: StepStatePlan) -> None:
        """The step failed: nothing it wrote is valid."""
        ck = self.checkpoints
        if ck is None:
            return
        for idx in plan.unpin:
            ck.unpin(idx)
        for idx, _ in plan.publish:
            ck.release(idx)
        for _, idx, _ in plan.pending:
            ck.release(idx)

    def stats(self) -> CheckpointStats | None:
        return self.checkpoints.snapshot() if self.checkpoints is not None else None

    def snapshots(self, remote: RemoteTier | None = None) -> list[TierSnapshot]:
        """The checkpoint media as the metrics report them, in entries (``capacity_blocks`` counts
        checkpoints, ``block_bytes`` is one checkpoint's size): the device pool (gpu: ``promotions``
        are restores into a request's slot, ``dropped`` captures skipped for want of an entry), the
        host tier (cpu) and the cache node (remote, whose capacity its own metrics report)."""
        s = self.stats()
        if s is None:
            return []
        out = [TierSnapshot(TIER_GPU, s.capacity, s.published, s.entry_bytes,
                            TierStats(hits=s.restores, promotions=s.restores, stored=s.saves,
                                      evictions=s.evictions, dropped=s.reserve_failures))]
        if self.host is not None:
            h = self.host
            out.append(TierSnapshot(TIER_CPU, h.num_slots, h.used, h.entry_bytes, TierStats(**h.stats.as_dict())))
        if remote is not None and remote.state_layout is not None:
            st = remote.snapshot_state_stats()
            st.promotions = self.remote_promotions  # fetched checkpoints that a hit resumed from
            out.append(TierSnapshot(TIER_REMOTE, 0, 0, remote.state_layout.nbytes, st))
        return out

    def check_integrity(self) -> None:
        self.slots.check_integrity()
        if self.checkpoints is not None:
            self.checkpoints.check_integrity()
            stray = set(self._pending) - self.slots.owners()
            assert not stray, f"requests without a slot keep pending checkpoints: {sorted(stray)}"
            assert not self._promoting, f"promotions neither allocated nor cancelled: {list(self._promoting)}"
        if self.host is not None:
            self.host.check_integrity()
            both = self.host.hashes() & self.checkpoints.hashes()
            assert not both, f"{len(both)} checkpoints held both on the device and in the host tier"
