"""``KVCacheMirror``: one engine's cached block hashes per tier, rebuilt from its KV events.

Pure in-memory state, no I/O: feed it the snapshot a subscriber fetched (``reset``) and the
records that follow (``apply_record``). Routers keep one per engine; tests compare it with
the engine's own ``KVEventLog.snapshot()``.

Invariant: after ``reset(s)`` and ``apply_record(r)`` for the records ``s.seq + 1 .. n`` of the
same engine, ``hashes`` equals the engine's snapshot at seq ``n`` (the ``KVEventLog`` invariant,
starting from a snapshot instead of from empty).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.engine.block_hash import BlockHash
from .events import TIERS, KVEvent, KVEventRecord, KVSnapshot, apply_event


def _empty_tiers() -> dict[str, set[BlockHash]]:
    return {t: set() for t in TIERS}


@dataclass
class KVCacheMirror:
    """The hashes one engine holds in each tier, as of record ``seq``."""

    engine_id: str = ""
    seq: int = 0
    hashes: dict[str, set[BlockHash]] = field(default_factory=_empty_tiers)

    def reset(self, snap: KVSnapshot) -> None:
        """Replace everything with the snapshot's contents (a resync)."""
        self.engine_id = snap.engine_id
        self.seq = snap.seq
        self.hashes = _empty_tiers()
        for tier, hs in snap.hashes.items():
            self.hashes.setdefault(tier, set()).update(hs)

    def apply(self, event: KVEvent) -> None:
        apply_event(self.hashes, event)

    def apply_record(self, rec: KVEventRecord) -> None:
        """Apply one record; the caller guarantees records arrive in seq order without gaps."""
        self.apply(rec.event)
        self.seq = rec.seq

    def on_event(self, engine_id: str, rec: KVEventRecord) -> None:
        """``KVEventSubscriber`` callback shape."""
        self.apply_record(rec)

    def snapshot(self) -> KVSnapshot:
        return KVSnapshot(self.seq, self.engine_id, {t: frozenset(hs) for t, hs in self.hashes.items()})

    def num_blocks(self, tier: str | None = None) -> int:
        """Cached blocks in ``tier``, or in all tiers together."""
        if tier is not None:
            return len(self.hashes.get(tier, ()))
        return sum(len(hs) for hs in self.hashes.values())

    def same_contents(self, snap: KVSnapshot) -> bool:
        """True when every tier holds exactly the snapshot's hashes (tiers absent on one side are empty)."""
        tiers = set(self.hashes) | set(snap.hashes)
        return all(self.hashes.get(t, set()) == set(snap.hashes.get(t, ())) for t in tiers)
