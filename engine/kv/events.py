"""KV events: what an engine's block pools tell the router and cache nodes about cached blocks.

A pool emits raw events (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``) in the order
its cache changes. ``KVEventLog`` turns them into an ordered stream: each record gets the
engine id and a sequence number that increases by exactly one per record, so a subscriber
that polls ``since(last_seq)`` notices any gap and resynchronises from ``snapshot()``.

Hybrid models' recurrent-state checkpoints (engine/kv/state_checkpoints.py) travel in the same
stream as ``BlockStored`` / ``BlockRemoved`` records of their own media, ``state-gpu`` (the
engine's checkpoint pool), ``state-cpu`` and ``state-remote``: a hash in ``state-gpu`` means
"a checkpoint exists at the end of this block", not that its KV is cached. A checkpoint record
names one or more hashes, no parent and no tokens (``checkpoint_stored``).

Invariant: replaying the records ``1 .. snapshot().seq`` onto empty per-medium sets (stored adds,
removed discards, cleared empties the medium) yields exactly ``snapshot().hashes``.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvmesh.engine.block_hash import BlockHash

TIER_GPU = "gpu"
"""The engine's primary KV pool (device memory; on a CPU-only build, the pool the model reads)."""
TIER_CPU = "cpu"
"""Engine host memory (offload tier)."""
TIER_REMOTE = "remote"
"""A cache node."""
TIERS = (TIER_GPU, TIER_CPU, TIER_REMOTE)
"""Where KV blocks live."""
STATE_MEDIA = {TIER_GPU: "state-gpu", TIER_CPU: "state-cpu", TIER_REMOTE: "state-remote"}
"""KV tier -> the medium of recurrent-state checkpoints kept there (hybrid models)."""
BRANCH_MEDIUM = "branch"
"""Hybrid models' branch points: block ends where prompts were seen to diverge and a checkpoint is
wanted (engine/kv/state_checkpoints.BranchPoints). Neither KV nor a checkpoint: a hint."""
MEDIA = TIERS + tuple(STATE_MEDIA.values()) + (BRANCH_MEDIUM,)
"""Every ``tier`` an event may carry (the ``medium`` field on the wire)."""


def check_tier(tier: str) -> str:
    """A KV tier (where a pool keeps blocks)."""
    if tier not in TIERS:
        raise ValueError(f"unknown KV tier {tier!r}; use one of {', '.join(TIERS)}")
    return tier


def check_medium(medium: str) -> str:
    """What an event may name: a KV tier or a checkpoint medium."""
    if medium not in MEDIA:
        raise ValueError(f"unknown KV tier or checkpoint medium {medium!r}; use one of {', '.join(MEDIA)}")
    return medium


def is_state_medium(tier: str) -> bool:
    """True for the media of recurrent-state checkpoints (not KV blocks)."""
    return tier.startswith("state-")


@dataclass(frozen=True)
class BlockStored:
    """Blocks now cached, in chain order.

    ``parent_hash`` is the hash of the block before ``block_hashes[0]``, or None when the first
    block follows the root seed. ``token_ids`` are the tokens of all listed blocks, concatenated
    (``len(token_ids) == len(block_hashes) * block_size``); on the wire they are empty unless the
    publisher was asked for them (``--kv-events-token-ids``): consumers key on hashes only.
    """

    block_hashes: list[BlockHash]
    parent_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    tier: str = TIER_GPU


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks no longer cached in ``tier`` (their memory was reused)."""

    block_hashes: list[BlockHash]
    tier: str = TIER_GPU


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every cached block of ``tier`` was dropped."""

    tier: str = TIER_GPU


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
KVEventHandler = Callable[[KVEvent], None]


def checkpoint_stored(hashes: list[BlockHash], block_size: int, tier: str = TIER_GPU) -> BlockStored:
    """Checkpoints now exist at the ends of the blocks ``hashes`` name (in ``tier``'s checkpoint
    store). No parent and no tokens: each hash stands alone, and a consumer that builds keys from
    tokens (llm-d's indexer) drops the record instead of indexing it as KV."""
    return BlockStored(list(hashes), None, [], block_size, STATE_MEDIA[tier])


def branch_points(hashes: list[BlockHash], block_size: int) -> BlockStored:
    """Branch points at the ends of the blocks ``hashes`` name (``BRANCH_MEDIUM``; shaped like a
    checkpoint record: no parent, no tokens)."""
    return BlockStored(list(hashes), None, [], block_size, BRANCH_MEDIUM)


def checkpoint_removed(hashes: list[BlockHash], tier: str = TIER_GPU) -> BlockRemoved:
    """The checkpoints at ``hashes`` were evicted from ``tier``'s checkpoint store."""
    return BlockRemoved(list(hashes), STATE_MEDIA[tier])


def apply_event(tiers: dict[str, set[BlockHash]], event: KVEvent) -> None:
    """Apply one event to per-tier hash sets: stored adds, removed discards, cleared empties.

    The one definition of what an event means for cache contents; the engine's log, every
    mirror of it and the router's index all replay events through it.
    """
    cached = tiers.setdefault(check_medium(event.tier), set())
    if isinstance(event, BlockStored):
        cached.update(event.block_hashes)
    elif isinstance(event, BlockRemoved):
        cached.difference_update(event.block_hashes)
    elif isinstance(event, AllBlocksCleared):
        cached.clear()
    else:
        raise TypeError(f"not a KV event: {event!r}")


@dataclass(frozen=True)
class KVEventRecord:
    seq: int
    engine_id: str
    timestamp: float
    event: KVEvent


@dataclass(frozen=True)
class KVSnapshot:
    """The cache contents as of record ``seq`` (0: before any event)."""

    seq: int
    engine_id: str
    hashes: dict[str, frozenset[BlockHash]] = field(default_factory=dict)


class KVEventLog:
    """Sequence-stamps events from one engine's pools and serves them to pollers.

    ``publish`` is the ``on_event`` callback for block pools (engine thread); ``since`` and
    ``snapshot`` are for readers (server thread). All three hold one lock, so a snapshot's
    ``seq`` matches its contents exactly. The ring keeps the most recent ``capacity`` records.
    ``wait_since`` lets a reader thread (the wire publisher) sleep until new records exist
    instead of polling; ``publish`` only notifies it, so the engine thread never waits on readers.
    """

    def __init__(self, engine_id: str, capacity: int = 10_000, clock: Callable[[], float] = time.time) -> None:
        if capacity < 1:
            raise ValueError(f"KVEventLog capacity must be >= 1, got {capacity}")
        self.engine_id = engine_id
        self.capacity = capacity
        self._clock = clock
        self._lock = threading.Lock()
        self._new_records = threading.Condition(self._lock)
        self._ring: deque[KVEventRecord] = deque(maxlen=capacity)
        self._seq = 0
        self._cached: dict[str, set[BlockHash]] = {t: set() for t in TIERS}

    def publish(self, event: KVEvent) -> KVEventRecord:
        check_medium(event.tier)  # reject before the event takes a sequence number
        with self._lock:
            self._seq += 1
            rec = KVEventRecord(self._seq, self.engine_id, self._clock(), event)
            self._ring.append(rec)
            apply_event(self._cached, event)
            self._new_records.notify_all()
            return rec

    __call__ = publish

    @property
    def latest_seq(self) -> int:
        with self._lock:
            return self._seq

    def since(self, seq: int, limit: int | None = None) -> list[KVEventRecord] | None:
        """Records with sequence number > ``seq``, oldest first (the first ``limit`` of them).

        Returns None when the caller cannot catch up from the ring: record ``seq + 1`` was
        already dropped, or ``seq`` is ahead of this log (the engine restarted). The caller must
        then resync from ``snapshot()`` and poll from its ``seq``.
        """
        if seq < 0:
            raise ValueError(f"since() needs a sequence number >= 0, got {seq}")
        with self._lock:
            if seq > self._seq:
                return None
            if seq == self._seq:
                return []
            oldest = self._ring[0].seq
            if seq + 1 < oldest:
                return None
            start = seq + 1 - oldest
            return list(itertools.islice(self._ring, start, None if limit is None else start + limit))

    @property
    def oldest_seq(self) -> int:
        """Sequence number of the oldest record still in the ring (``latest_seq + 1`` when empty)."""
        with self._lock:
            return self._ring[0].seq if self._ring else self._seq + 1

    def wait_since(self, seq: int, timeout: float | None = None) -> list[KVEventRecord] | None:
        """Like ``since(seq)``, but first waits up to ``timeout`` seconds for a record after ``seq``.

        Returns ``[]`` when nothing new arrived in time (or ``wake()`` was called).
        """
        with self._lock:
            if self._seq <= seq:
                self._new_records.wait(timeout)
        return self.since(seq)

    def wake(self) -> None:
        """Wake every thread blocked in ``wait_since`` (used to stop a reader promptly)."""
        with self._lock:
            self._new_records.notify_all()

    def snapshot(self) -> KVSnapshot:
        with self._lock:
            return KVSnapshot(self._seq, self.engine_id,
                              {t: frozenset(s) for t, s in self._cached.items()})
