"""The router's prefix index: which engine holds which KV blocks, per tier, right now.

Built only from KV events and snapshots, so it mirrors what engines hold now, not what they
ever held: a stored event adds hashes, a removed event discards them, a cleared event empties
the tier, a snapshot replaces an engine's sets, and removing an engine frees all its entries.

Invariants:
- For every engine the index holds exactly the union of the per-tier hash sets that replaying
  its events onto its last snapshot yields; memory is bounded by the fleet's cache size.
- ``longest_prefix`` only counts a contiguous run from block 0: the hash chain makes block
  ``i`` name its whole prefix, so a hit after a miss cannot be used by the engine anyway.
- A hybrid engine's match (``restore_points=True``) is that run cut back to its last block whose
  end has a recurrent-state checkpoint (any ``state-*`` medium), by the function the engine's
  admission uses (``state_checkpoints.restorable_blocks``); checkpoint hashes never count as
  KV blocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvmesh.engine.block_hash import BlockHash
from kvmesh.engine.kv.events import (
    BRANCH_MEDIUM,
    TIER_CPU,
    TIER_GPU,
    TIER_REMOTE,
    TIERS,
    KVEvent,
    KVSnapshot,
    apply_event,
    check_medium,
    is_state_medium,
)
from kvmesh.engine.kv.state_checkpoints import restorable_blocks

TIER_WEIGHTS: Mapping[str, float] = {TIER_GPU: 1.0, TIER_CPU: 0.8, TIER_REMOTE: 0.5}
"""Worth of one matched block by the tier it sits in (gpu > cpu > remote): a gpu hit is free,
a cpu hit costs a host-to-device copy, a remote hit a network transfer first."""


@dataclass(frozen=True)
class PrefixMatch:
    """One engine's longest cached prefix of a request.

    ``blocks`` counts matched leading blocks; ``per_tier[t]`` how many of them were found in
    tier ``t`` (a block in several tiers counts in the best one); ``weighted`` is the sum of
    their tier weights, so ``weighted <= blocks`` with equality iff every block is on gpu.
    """

    blocks: int = 0
    per_tier: Mapping[str, int] = field(default_factory=dict)
    weighted: float = 0.0


NO_MATCH = PrefixMatch()


@dataclass
class _EngineEntry:
    tiers: dict[str, set[BlockHash]] = field(default_factory=lambda: {t: set() for t in TIERS})


class PrefixIndex:
    """Per engine, per tier, the set of cached block hashes.

    Not thread-safe: the router mutates and reads it from its one event loop.
    """

    def __init__(self, tier_weights: Mapping[str, float] = TIER_WEIGHTS) -> None:
        missing = [t for t in TIERS if t not in tier_weights]
        if missing:
            raise ValueError(f"tier weights need a value for every tier; missing {', '.join(missing)}")
        # Tiers in descending weight: a block found in several tiers counts in the best.
        self._order = tuple(sorted(TIERS, key=lambda t: -tier_weights[t]))
        self._weights = dict(tier_weights)
        self._engines: dict[str, _EngineEntry] = {}

    # ---- mutation ------------------------------------------------------------------------
    def apply(self, engine: str, event: KVEvent) -> None:
        """Apply one event from ``engine`` (an unknown engine is added)."""
        apply_event(self._entry(engine).tiers, event)

    def reset(self, engine: str, snapshot: KVSnapshot) -> None:
        """Replace everything known about ``engine`` with ``snapshot``'s contents."""
        entry = _EngineEntry()
        for tier, hashes in snapshot.hashes.items():
            entry.tiers[check_medium(tier)] = set(hashes)
        self._engines[engine] = entry

    def remove_engine(self, engine: str) -> None:
        """Forget ``engine`` and free its entries (a no-op for an unknown engine)."""
        self._engines.pop(engine, None)

    def _entry(self, engine: str) -> _EngineEntry:
        entry = self._engines.get(engine)
        if entry is None:
            entry = self._engines[engine] = _EngineEntry()
        return entry

    # ---- queries -------------------------------------------------------------------------
    def engines(self) -> list[str]:
        return list(self._engines)

    def __contains__(self, engine: str) -> bool:
        return engine in self._engines

    def hashes(self, engine: str) -> dict[str, frozenset[BlockHash]]:
        """A copy of ``engine``'s per-tier sets (empty sets for an unknown engine)."""
        entry = self._engines.get(engine)
        return {t: frozenset(entry.tiers[t]) if entry else frozenset() for t in TIERS}

    def size(self) -> dict[str, dict[str, int]]:
        """Number of hashes held per engine and tier."""
        return {e: {t: len(s) for t, s in entry.tiers.items()} for e, entry in self._engines.items()}

    def total_size(self) -> int:
        return sum(len(s) for entry in self._engines.values() for s in entry.tiers.values())

    def match(self, engine: str, hashes: Sequence[BlockHash], restore_points: bool = False) -> PrefixMatch:
        """``engine``'s longest cached prefix of ``hashes`` (``NO_MATCH`` for an unknown engine).

        ``restore_points``: ``engine`` is hybrid, so the prefix ends at its last block with a
        checkpoint. ``hashes`` must then stop where the engine's own lookup stops (it leaves the
        prompt's last token to compute: ``block_hash.max_hit_blocks`` with ``whole=False``), since
        the cut back is made from there.
        """
        entry = self._engines.get(engine)
        if entry is None or not hashes:
            return NO_MATCH
        sets = [(t, entry.tiers[t]) for t in self._order if entry.tiers[t]]
        found: list[str] = []  # the tier each leading block was found in
        for h in hashes:
            for tier, s in sets:
                if h in s:
                    found.append(tier)
                    break
            else:
                break
        n = len(found)
        if restore_points and n:
            ckpts = [s for t, s in entry.tiers.items() if is_state_medium(t) and s]
            n = restorable_blocks(hashes, n, lambda h: any(h in s for s in ckpts))
        if n == 0:
            return NO_MATCH
        counts: dict[str, int] = {}
        for tier in found[:n]:
            counts[tier] = counts.get(tier, 0) + 1
        weighted = sum(self._weights[t] * c for t, c in counts.items())
        return PrefixMatch(n, counts, weighted)

    def wanted_checkpoints(self, engines: Iterable[str], hashes: Sequence[BlockHash]) -> list[int]:
        """Block counts ``j`` of ``hashes`` (cut where a hybrid lookup stops) at whose end a hybrid
        engine computing the prompt should checkpoint, sorted: where one of ``engines``' cached KV
        of the prompt ends past its last checkpoint there (the prompt leaves a cached one at that
        block, so the next one sharing it may too), and each block an engine reported as a
        branch point (``BRANCH_MEDIUM``)."""
        out: set[int] = set()
        branch = [s for e in engines if (entry := self._engines.get(e)) and (s := entry.tiers.get(BRANCH_MEDIUM))]
        for e in engines:
            kv = self.match(e, hashes).blocks
            if kv and self.match(e, hashes, restore_points=True).blocks < kv:
                out.add(kv)
        if branch:
            out.update(j for j, h in enumerate(hashes, 1) if any(h in s for s in branch))
        return sorted(out)

    def longest_prefix(self, hashes: Sequence[BlockHash], engines: Iterable[str] | None = None) -> dict[str, PrefixMatch]:
        """Every engine's (or each of ``engines``') longest cached prefix of ``hashes``."""
        names = self._engines if engines is None else engines
        return {e: self.match(e, hashes) for e in names}
