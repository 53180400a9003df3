"""The cache node's block store: blocks by hash in RAM, LRU, inside a byte budget. No I/O here.

A put is two-phase so that bytes still on the wire are bounded too: ``offer`` decides per block
(wanted, or already held/in flight, or refused) and reserves in-flight room for the wanted ones,
evicting nothing; ``commit`` stores a block that arrived, evicting least recently used blocks
only then and only as many as its bytes need; ``abandon`` gives a reservation back when the
transfer failed. ``put`` does both for callers that already hold the bytes. So an offer, however
large, that never sends its bytes costs the cache nothing: it only waits out its timeout.

Invariants (``check_integrity`` asserts them):

* ``used_bytes <= capacity_bytes`` and ``reserved_bytes <= max_inflight_bytes`` at every point;
  evicted blocks' arrays nobody else holds are kept (at most ``max_inflight_bytes`` of them) to
  receive later puts into, so memory held is at most capacity + 2 x the in-flight limit; a block
  larger than the whole budget is refused (``TOO_LARGE``), never stored; one offer reserves at
  most its ``max_bytes``;
* a hash is held at most once, and is either stored or pending (in flight), never both;
* the LRU order is: least recently stored/read first; ``lookup`` does not refresh recency
  (a probe is not a use), ``get`` does;
* a hash that is stored or pending with one layout is never offered, stored or served under
  another: that raises ``HeaderMismatch`` naming the field and counts a rejected header.

Two kinds of entry share the budget and the LRU (``BlockLayout.kind``): KV blocks, keyed by
their hash, and recurrent-state checkpoints of hybrid models, keyed by (``state``, hash) since a
checkpoint carries the hash of the block it ends. ``lookup`` concerns KV blocks only; checkpoints
are announced in their own medium, ``state-remote`` (``kv.events.checkpoint_stored``), so an
event consumer never takes one for a KV block; ``get`` with a state layout answers the
*first* of the asked hashes it holds, one entry (the engine asks deepest boundary first: a
restore needs one checkpoint, the latest).

Thread-safety: one lock around every method, so the HTTP side port (metrics, snapshot) may read
while the transfer loop writes. Events (tier ``remote``) are emitted under that lock, in the
order the contents change, so an event log's snapshot always matches the store.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import numpy as np

from kvmesh.engine.block_hash import BlockHash
from ..kv.events import TIER_REMOTE, BlockRemoved, BlockStored, KVEventHandler, checkpoint_removed, checkpoint_stored
from ..transfer.errors import HeaderMismatch
from ..transfer.header import KIND_STATE, BlockBatch, BlockHeader, BlockLayout, check_batch, check_layout
from ..transfer.protocol import EXISTS, NO_ROOM, STORED, TOO_LARGE

EntryKey = BlockHash | tuple[str, BlockHash]


def entry_key(layout: BlockLayout, block_hash: BlockHash) -> EntryKey:
    """A KV block's key is its hash; a checkpoint's is (kind, hash): both may exist for one hash."""
    return (KIND_STATE, block_hash) if layout.kind == KIND_STATE else block_hash


WANTED = None
"""``offer`` verdict for a block whose bytes should be sent (room is reserved for it)."""


@dataclass
class StoreStats:
    """Counters since start (blocks unless named bytes)."""

    puts: int = 0
    """Blocks stored."""
    put_duplicates: int = 0
    """Offered blocks already held or in flight (not sent again)."""
    put_refused: int = 0
    """Offered blocks refused (too large or no room)."""
    put_aborted: int = 0
    """Reservations given back because the transfer failed."""
    lookups: int = 0
    lookup_hits: int = 0
    """Blocks found by lookups (sum of the returned prefix lengths)."""
    gets: int = 0
    """Blocks asked for by gets."""
    hits: int = 0
    """Blocks served by gets."""
    evictions: int = 0
    rejected_headers: int = 0
    put_bytes: int = 0
    """Bytes received by puts (stored blocks' buffers)."""
    hit_bytes: int = 0
    """Bytes served by gets."""

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class _News:
    """What one ``commit_many`` changed and has not announced yet."""

    evicted: list[BlockHash] = field(default_factory=list)
    states: list[BlockHash] = field(default_factory=list)
    stored: list[BlockHeader] = field(default_factory=list)
    stored_keys: set[EntryKey] = field(default_factory=set)
    count: int = 0


@dataclass(frozen=True)
class StoredBlock:
    header: BlockHeader
    data: np.ndarray


class BlockStore:
    def __init__(self, capacity_bytes: int, on_event: KVEventHandler | None = None,
                 max_inflight_bytes: int | None = None) -> None:
        """``max_inflight_bytes``: room for blocks offered and not yet arrived, all connections
        together (default: ``capacity_bytes``)."""
        if capacity_bytes < 1:
            raise ValueError(f"cache capacity must be >= 1 byte, got {capacity_bytes}")
        if max_inflight_bytes is not None and max_inflight_bytes < 1:
            raise ValueError(f"the in-flight limit must be >= 1 byte, got {max_inflight_bytes}")
        self.capacity_bytes = capacity_bytes
        self.max_inflight_bytes = capacity_bytes if max_inflight_bytes is None else max_inflight_bytes
        self._on_event = on_event
        self._lock = threading.Lock()
        self._blocks: OrderedDict[EntryKey, StoredBlock] = OrderedDict()  # oldest use first
        self._pending: dict[EntryKey, BlockLayout] = {}
        self._used = 0
        self._reserved = 0
        self._spare: dict[int, list[np.ndarray]] = {}
        self._spare_bytes = 0
        self.stats = StoreStats()

    # ---- two-phase put ------------------------------------------------------------------------
    def offer(self, batch: BlockBatch, max_bytes: int | None = None) -> list[str | None]:
        """Per block: ``WANTED`` (room reserved; send it) or ``EXISTS``/``TOO_LARGE``/``NO_ROOM``.

        ``NO_ROOM``: the in-flight room (``max_inflight_bytes``) or this offer's own limit
        ``max_bytes`` (one connection's share) is taken. Nothing is evicted here.

        Raises ``HeaderMismatch`` (nothing reserved) if the batch is malformed or names a hash held
        under another layout.
        """
        with self._lock:
            try:
                check_batch(batch)
                for h in batch.hashes:
                    k = entry_key(batch.layout, h)
                    known = self._blocks.get(k)
                    layout = known.header.layout if known is not None else self._pending.get(k)
                    if layout is not None:
                        check_layout(layout, batch.layout)
            except HeaderMismatch:
                self.stats.rejected_headers += 1
                raise
            size = batch.layout.nbytes
            room = self.max_inflight_bytes if max_bytes is None else min(self.max_inflight_bytes, max_bytes)
            offered = 0
            out: list[str | None] = []
            for h in batch.hashes:
                h = entry_key(batch.layout, h)
                if h in self._blocks or h in self._pending:
                    self.stats.put_duplicates += 1
                    out.append(EXISTS)
                elif size > self.capacity_bytes:
                    self.stats.put_refused += 1
                    out.append(TOO_LARGE)
                elif self._reserved + size > self.max_inflight_bytes or offered + size > room:
                    self.stats.put_refused += 1
                    out.append(NO_ROOM)
                else:
                    offered += size
                    self._reserved += size
                    self._pending[h] = batch.layout
                    out.append(WANTED)
            return out

    def commit(self, header: BlockHeader, data: np.ndarray) -> str:
        """Store a block ``offer`` wanted; its reservation becomes used bytes. Returns ``STORED``."""
        return self.commit_many([header], [data])[0]

    def commit_many(self, headers: Sequence[BlockHeader], datas: Sequence[np.ndarray]) -> list[str]:
        """``commit`` each block, in order, under one lock, with their events merged: one
        ``BlockRemoved`` for the room made (before anything it makes room for is announced) and one
        ``BlockStored`` per run of blocks that continue each other's chain. Stops at the first
        block that raises; the ones before it stay stored and announced.

        Why batched: a put of hundreds of blocks announced one event at a time woke the event
        publisher's thread hundreds of times, and the handler waited on the GIL for it."""
        with self._lock:
            news = _News()
            try:
                for header, data in zip(headers, datas):
                    self._commit_one(header, data, news)
            finally:
                self._announce(news)
            return [STORED] * news.count

    def buffer(self, nbytes: int) -> np.ndarray:
        """An array to receive a wanted block into: the memory of an evicted block of that size when
        one is spare (touched already: no page faults on the way in), else a new one."""
        with self._lock:
            spare = self._spare.get(nbytes)
            if spare:
                self._spare_bytes -= nbytes
                return spare.pop()
        return np.empty(nbytes, np.uint8)

    def _keep_spare(self, blk: StoredBlock) -> None:
        # Only memory nobody else can see: a get may still be sending an evicted block (its list
        # of StoredBlocks, a view, a posted send all hold references). CPython's reference counts
        # say exactly that: the StoredBlock is held by the caller's local alone, its array by it.
        data = blk.data
        if (sys.getrefcount(blk) > 3 or sys.getrefcount(data) > 3 or data.base is not None
                or self._spare_bytes + data.nbytes > self.max_inflight_bytes):
            return
        self._spare.setdefault(data.nbytes, []).append(data)
        self._spare_bytes += data.nbytes

    def _commit_one(self, header: BlockHeader, data: np.ndarray, news: _News) -> None:
        key = entry_key(header.layout, header.block_hash)
        layout = self._pending.pop(key, None)
        if layout is None:
            raise KeyError(f"block {header.block_hash.hex()[:16]} was not offered (or was abandoned)")
        self._reserved -= layout.nbytes
        if header.layout != layout or data.nbytes != layout.nbytes:
            self.stats.rejected_headers += 1
            check_layout(layout, header.layout)
            raise HeaderMismatch("buffers", f"{layout.nbytes} bytes", f"{data.nbytes} bytes")
        while self._used + data.nbytes > self.capacity_bytes:
            victim, blk = self._blocks.popitem(last=False)
            self._used -= blk.data.nbytes
            self.stats.evictions += 1
            self._keep_spare(blk)
            if victim in news.stored_keys:  # the batch outgrew the budget: announce what came before
                self._announce(news)
            (news.evicted if isinstance(victim, bytes) else news.states).append(blk.header.block_hash)
        self._blocks[key] = StoredBlock(header, data)
        self._used += data.nbytes
        self.stats.puts += 1
        self.stats.put_bytes += data.nbytes
        news.stored.append(header)
        news.stored_keys.add(key)
        news.count += 1

    def _announce(self, news: _News) -> None:
        """Emit (and forget) the removals, then the stores in chain runs. Removals go first: none
        of them is among the stores (``_commit_one`` announces before that could happen)."""
        if news.evicted:
            self._emit(BlockRemoved(news.evicted, TIER_REMOTE))
        if news.states:
            self._emit(checkpoint_removed(news.states, TIER_REMOTE))
        run: list[BlockHeader] = []
        for h in news.stored:
            if h.layout.kind == KIND_STATE:
                self._emit(checkpoint_stored([h.block_hash], h.layout.block_size, TIER_REMOTE))
                continue
            if run and (h.parent_hash != run[-1].block_hash or h.layout.block_size != run[0].layout.block_size):
                self._emit_run(run)
                run = []
            run.append(h)
        if run:
            self._emit_run(run)
        news.evicted, news.states, news.stored = [], [], []
        news.stored_keys.clear()

    def _emit_run(self, run: list[BlockHeader]) -> None:
        self._emit(BlockStored([h.block_hash for h in run], run[0].parent_hash, [], run[0].layout.block_size,
                               TIER_REMOTE))

    def abandon(self, block_hash: BlockHash, layout: BlockLayout | None = None) -> None:
        """Give back the reservation of an offered block (of ``layout``'s kind; default KV) that
        will not arrive. Idempotent."""
        with self._lock:
            layout = self._pending.pop(block_hash if layout is None else entry_key(layout, block_hash), None)
            if layout is not None:
                self._reserved -= layout.nbytes
                self.stats.put_aborted += 1

    def put(self, header: BlockHeader, data: np.ndarray) -> str:
        """Offer and commit one block whose bytes are at hand."""
        verdict = self.offer(BlockBatch(header.layout, [header.block_hash], [header.parent_hash]))[0]
        return self.commit(header, data) if verdict is WANTED else verdict

    # ---- reads --------------------------------------------------------------------------------
    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        """Length of the longest prefix of ``hashes`` that is stored (pending blocks do not count)."""
        with self._lock:
            n = 0
            for h in hashes:
                if h not in self._blocks:
                    break
                n += 1
            self.stats.lookups += 1
            self.stats.lookup_hits += n
            return n

    def get(self, layout: BlockLayout, hashes: Sequence[BlockHash]) -> list[StoredBlock]:
        """Blocks of the longest stored prefix of ``hashes``, now most recently used.

        Raises ``HeaderMismatch`` if a block of that prefix was stored under another layout.
        """
        with self._lock:
            out: list[StoredBlock] = []
            state = layout.kind == KIND_STATE
            for h in hashes:
                blk = self._blocks.get(entry_key(layout, h))
                if blk is None:
                    if state:
                        continue  # a checkpoint get answers the first held hash
                    break
                if blk.header.layout != layout:
                    self.stats.rejected_headers += 1
                    check_layout(layout, blk.header.layout)
                out.append(blk)
                if state:
                    break
            for blk in out:
                self._blocks.move_to_end(entry_key(layout, blk.header.block_hash))
            self.stats.gets += 1 if state else len(hashes)
            self.stats.hits += len(out)
            self.stats.hit_bytes += sum(blk.data.nbytes for blk in out)
            return out

    def __contains__(self, block_hash: object) -> bool:
        with self._lock:
            return block_hash in self._blocks

    def lru_order(self) -> list[BlockHash]:
        """Stored hashes, the next eviction victim first."""
        with self._lock:
            return list(self._blocks)

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def reserved_bytes(self) -> int:
        return self._reserved

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    def check_integrity(self) -> None:
        with self._lock:
            used = sum(b.data.nbytes for b in self._blocks.values())
            reserved = sum(layout.nbytes for layout in self._pending.values())
            assert used == self._used, f"used bytes {self._used} != stored {used}"
            assert reserved == self._reserved, f"reserved bytes {self._reserved} != pending {reserved}"
            assert self._used <= self.capacity_bytes, "over budget"
            assert self._reserved <= self.max_inflight_bytes, "over the in-flight limit"
            assert not (self._blocks.keys() & self._pending.keys()), "a hash both stored and pending"

    # ---- internals ------------------------------------------------------------------------------
    def _emit(self, event: BlockStored | BlockRemoved) -> None:
        if self._on_event is not None:
            self._on_event(event)
