"""The host tier (``cpu``): KV blocks evicted from the primary pool, kept in host memory, LRU.

A block is one slot of ``data`` (``[slots, layers, 2, block_size, kv_heads, head_dim]``), so a
slot is exactly the wire payload of a block (``k.0, v.0, k.1, v.1, ...``). The tier only moves
bytes when ``flush`` runs, once per engine step, before the forward pass:

1. saves: every block the primary pool evicted since the last flush is gathered from the KV
   cache in one ``index_select`` and written into its slot (one ``index_copy_``; on CUDA the
   device-to-host copies go to pinned memory on a side stream);
2. loads: every promoted slot is read (one ``index_select``) for the caller to scatter into the
   freshly allocated primary blocks.

Saves run before loads because a block evicted in a step may be the very block a promotion
loads into in the same step.

Invariants (``check_integrity``):

* every slot is in exactly one of: ``_lru`` (cached, evictable), ``_reserved`` (cached, held by
  an admission between ``reserve`` and ``promote``/``release``), ``_free``, ``_quarantine``
  (freed since the last flush; a pending load may still read it, so it is not reused before
  the flush);
* a hash is held at most once; ``used_blocks == len(_lru) + len(_reserved)``;
* a slot with a pending save holds the hash its index entry says once the flush ran;
* events: ``BlockStored``/``BlockRemoved`` with tier ``cpu`` in the order the index changes
  (parents as the primary pool knew them; ``token_ids`` empty: the tier never sees tokens).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields

import torch

from kvmesh.engine.block_hash import BlockHash
from .block_pool import KVBlock, KVIntegrityError
from .host_copy import HostCopier
from .events import TIER_CPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEventHandler


@dataclass
class TierStats:
    """Cumulative counters of one lower tier (tokens where named, blocks otherwise)."""

    queries: int = 0
    """Tokens looked up in this tier at admissions (the part of the chain the tiers above missed)."""
    hits: int = 0
    """Tokens of those found here and loaded into the primary pool."""
    promotions: int = 0
    """Blocks copied into the primary pool and inserted into its prefix index."""
    stored: int = 0
    """Blocks written into this tier."""
    evictions: int = 0
    """Blocks dropped from this tier to make room."""
    dropped: int = 0
    """Saves not made (no room, a busy or unreachable cache node)."""
    failures: int = 0
    """Lookups or saves that failed (timeouts, a dead node, a header mismatch): recompute."""

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(slots=True)
class _Entry:
    slot: int
    parent: BlockHash | None


class HostTier:
    """LRU pool of ``num_slots`` blocks of shape ``block_shape`` in host memory."""

    def __init__(self, num_slots: int, block_shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, block_size: int, on_event: KVEventHandler | None = None) -> None:
        if num_slots < 1:
            raise ValueError(f"the host KV tier needs room for at least one block, got {num_slots} slots; "
                             "raise --cpu-kv-bytes")
        self.num_slots = num_slots
        self.block_size = block_size
        self.device = device
        self.on_event = on_event
        pin = device.type == "cuda"
        self.data = torch.empty((num_slots, *block_shape), dtype=dtype, pin_memory=pin)
        self.block_bytes = self.data[0].numel() * self.data.element_size()
        self._lru: OrderedDict[BlockHash, _Entry] = OrderedDict()  # least recently used first
        self._reserved: dict[BlockHash, _Entry] = {}
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._quarantine: list[int] = []
        self._saves: dict[int, int] = {}  # slot -> primary block id, pending until flush
        self._loads: list[tuple[int, int]] = []  # (slot, primary block id), pending until flush
        self._copies = HostCopier(device)
        self.stats = TierStats()

    # ---- queries ------------------------------------------------------------------------------
    @property
    def used_blocks(self) -> int:
        return len(self._lru) + len(self._reserved)

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.block_bytes

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._lru or block_hash in self._reserved

    def count(self, hashes: Sequence[BlockHash]) -> int:
        """Length of the longest prefix of ``hashes`` held here. Changes nothing."""
        n = 0
        for h in hashes:
            if h not in self._lru:
                break
            n += 1
        return n

    # ---- admission ----------------------------------------------------------------------------
    def reserve(self, hashes: Sequence[BlockHash]) -> None:
        """Hold these (held) blocks for one admission: not evicted until ``promote`` or ``release``."""
        for h in hashes:
            self._reserved[h] = self._lru.pop(h)

    def release(self, hashes: Sequence[BlockHash]) -> None:
        """Undo ``reserve`` (the admission did not happen); the blocks become most recently used."""
        for h in hashes:
            self._lru[h] = self._reserved.pop(h)

    def promote(self, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> None:
        """Move reserved blocks into primary blocks ``block_ids``: the load is queued for the next
        flush, the hashes leave this tier (one ``BlockRemoved``), the slots wait in quarantine."""
        if len(hashes) != len(block_ids):
            raise ValueError(f"{len(hashes)} hashes but {len(block_ids)} target blocks")
        if not hashes:
            return
        for h, b in zip(hashes, block_ids):
            e = self._reserved.pop(h)
            self._loads.append((e.slot, b))
            self._quarantine.append(e.slot)
        self.stats.promotions += len(hashes)
        self._emit(BlockRemoved(list(hashes), TIER_CPU))

    # ---- saves --------------------------------------------------------------------------------
    def save(self, blocks: Iterable[KVBlock]) -> None:
        """Take in blocks the primary pool just evicted (hash and parent still set). The copy
        happens at the next flush; a block that finds no slot (every slot reserved or freed
        this step) is dropped and counted."""
        stored: list[tuple[BlockHash, BlockHash | None]] = []
        for b in blocks:
            h = b.block_hash
            if h is None or h in self:
                continue
            slot = self._take_slot()
            if slot is None:
                self.stats.dropped += 1
                continue
            self._saves[slot] = b.block_id
            self._lru[h] = _Entry(slot, b.parent_hash)
            stored.append((h, b.parent_hash))
        if stored:
            self.stats.stored += len(stored)
            self._emit_stored(stored)

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        if not self._lru:
            return None
        h, e = self._lru.popitem(last=False)
        self.stats.evictions += 1
        self._emit(BlockRemoved([h], TIER_CPU))
        self._saves.pop(e.slot, None)  # saved and evicted in one step: its copy is moot
        return e.slot

    def discard(self, hashes: Iterable[BlockHash]) -> None:
        """Drop hashes the primary pool now holds again (a block lives in one tier at a time)."""
        gone = []
        for h in hashes:
            e = self._lru.pop(h, None)
            if e is not None:
                self._saves.pop(e.slot, None)
                self._quarantine.append(e.slot)
                gone.append(h)
        if gone:
            self._emit(BlockRemoved(gone, TIER_CPU))

    def clear(self) -> None:
        """Forget every block (the primary pool's prefix cache was reset). Reserved blocks stay."""
        for e in self._lru.values():
            self._saves.pop(e.slot, None)
            self._quarantine.append(e.slot)
        self._lru.clear()
        self._emit(AllBlocksCleared(TIER_CPU))

    # ---- data movement ------------------------------------------------------------------------
    @property
    def has_pending(self) -> bool:
        return bool(self._saves or self._loads or self._quarantine)

    def flush_saves(self, kv_cache: torch.Tensor) -> None:
        """Copy the pending saves out of ``kv_cache`` ([layers, 2, blocks, ...]); call before the
        step's forward pass (which may overwrite the evicted blocks)."""
        if not self._saves:
            return
        slots = torch.tensor(list(self._saves), dtype=torch.int64)
        ids = torch.tensor(list(self._saves.values()), dtype=torch.int64, device=kv_cache.device)
        self._saves.clear()
        self._copies.save([self.data], [kv_cache.index_select(2, ids).movedim(2, 0)], slots)  # [n, layers, 2, ...]

    def take_loads(self) -> tuple[torch.Tensor, list[int]] | None:
        """The pending loads as (host tensor [n, layers, 2, ...], target primary block ids), and
        the quarantined slots back to the free list. Call after ``flush_saves``."""
        self._copies.wait()  # a promoted slot may have been saved this very step
        loads, self._loads = self._loads, []
        self._free.extend(self._quarantine)
        self._quarantine.clear()
        if not loads:
            return None
        slots = torch.tensor([s for s, _ in loads], dtype=torch.int64)
        return self.data.index_select(0, slots), [b for _, b in loads]

    # ---- events and checks --------------------------------------------------------------------
    def _emit_stored(self, stored: list[tuple[BlockHash, BlockHash | None]]) -> None:
        """One BlockStored per run of blocks that chain onto each other."""
        run: list[BlockHash] = []
        parent: BlockHash | None = None
        for h, p in stored:
            if run and p == run[-1]:
                run.append(h)
                continue
            if run:
                self._emit(BlockStored(run, parent, [], self.block_size, TIER_CPU))
            run, parent = [h], p
        self._emit(BlockStored(run, parent, [], self.block_size, TIER_CPU))

    def _emit(self, event: BlockStored | BlockRemoved | AllBlocksCleared) -> None:
        if self.on_event is not None:
            self.on_event(event)

    def hashes(self) -> set[BlockHash]:
        return set(self._lru) | set(self._reserved)

    def check_integrity(self) -> None:
        slots = ([e.slot for e in self._lru.values()] + [e.slot for e in self._reserved.values()]
                 + self._free + self._quarantine)
        errors = []
        if sorted(slots) != list(range(self.num_slots)):
            errors.append(f"slots are not partitioned: {len(slots)} listed for {self.num_slots}")
        if self._lru.keys() & self._reserved.keys():
            errors.append("a hash is both evictable and reserved")
        if errors:
            raise KVIntegrityError("host KV tier integrity violated: " + "; ".join(errors))
