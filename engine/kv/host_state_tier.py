"""The host tier of recurrent-state checkpoints (hybrid models): entries evicted from the device
checkpoint pool, kept in host memory by hash, LRU, inside their own byte budget.

A checkpoint is big and fixed-size (every DeltaNet layer's conv state in the model dtype and
recurrent state in fp32; ``StatePool.bytes_per_slot``), so it gets a pool of its own rather
than sharing the KV host tier's slots: ``conv [slots, L, C, K-1]`` and ``ssm [slots, L, Hv, Dk,
Dv]``. The tier moves bytes only in ``flush``, once per step, after the step's state plan and
before the forward pass (which writes the device entries):

1. saves: every device entry evicted since the last flush (``CheckpointIndex.reserve`` evicted
   it and will let this step overwrite it) is gathered with one ``index_select`` per tensor and
   written into its host slot with one ``index_copy_`` (on CUDA: the gather on the compute
   stream, the copy into pinned memory on a side stream);
2. loads: every promoted slot is copied into the device entry its promotion reserved, with one
   ``index_copy_`` per tensor, before the runner restores entries into request slots.

Saves run before loads because an entry evicted in a step may be the very entry a promotion
loads into in the same step.

Invariants (``check_integrity``): every slot is in exactly one of ``_lru`` (held, evictable),
``_reserved`` (held, found by an admission that has not promoted it yet), ``_free`` or
``_quarantine`` (promoted or dropped since the last flush: a pending load may still read it);
a hash is held at most once, and never both here and in the device index (the manager moves
it: eviction down, promotion up, a device publish drops the host copy). Stored bytes never
exceed the budget; a save that finds no slot is dropped and counted.

``on_stored(hashes)`` / ``on_removed(hashes)``, when set, hear every hash entering or leaving the
tier (a save; an LRU eviction, a promotion up or a discard), in the order the contents change:
the engine turns them into ``state-cpu`` KV events, so the router knows which boundaries can be
restored from host memory.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

import torch

from kvmesh.engine.block_hash import BlockHash
from .block_pool import KVIntegrityError
from .host_copy import HostCopier
from .host_tier import TierStats


class HostStateTier:
    """LRU pool of ``num_slots`` checkpoints; ``conv_shape``/``ssm_shape`` are one entry's shapes."""

    def __init__(self, num_slots: int, conv_shape: tuple[int, ...], conv_dtype: torch.dtype,
                 ssm_shape: tuple[int, ...], device: torch.device) -> None:
        if num_slots < 1:
            raise ValueError(f"the host checkpoint tier needs room for at least one checkpoint, got {num_slots} "
                             "slots; raise --cpu-state-bytes")
        self.num_slots = num_slots
        pin = device.type == "cuda"
        self.conv = torch.empty((num_slots, *conv_shape), dtype=conv_dtype, pin_memory=pin)
        self.ssm = torch.empty((num_slots, *ssm_shape), dtype=torch.float32, pin_memory=pin)
        self.entry_bytes = (self.conv[0].numel() * self.conv.element_size()
                            + self.ssm[0].numel() * self.ssm.element_size())
        self._lru: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first
        self._reserved: dict[BlockHash, int] = {}
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._quarantine: list[int] = []
        self._saves: dict[int, int] = {}  # host slot -> device entry, pending until flush
        self._loads: list[tuple[int, int]] = []  # (host slot, device entry), pending until flush
        self._copies = HostCopier(device)
        self.stats = TierStats()
        self.on_stored: Callable[[list[BlockHash]], None] | None = None
        self.on_removed: Callable[[list[BlockHash]], None] | None = None

    # ---- queries ------------------------------------------------------------------------------
    @property
    def used(self) -> int:
        return len(self._lru) + len(self._reserved)

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.entry_bytes

    def __contains__(self, h: object) -> bool:
        return h in self._lru or h in self._reserved

    def has(self, h: BlockHash) -> bool:
        """True when ``h`` is held and free to promote (not reserved by another admission)."""
        return h in self._lru

    def hashes(self) -> set[BlockHash]:
        return set(self._lru) | set(self._reserved)

    # ---- admission ----------------------------------------------------------------------------
    def reserve(self, h: BlockHash) -> None:
        """Hold ``h`` for one admission: not evicted until ``promote`` or ``release``."""
        self._reserved[h] = self._lru.pop(h)

    def release(self, h: BlockHash) -> None:
        """Undo ``reserve`` (the admission did not happen); ``h`` becomes most recently used."""
        self._lru[h] = self._reserved.pop(h)

    def promote(self, h: BlockHash, entry: int) -> None:
        """Move reserved ``h`` into device entry ``entry``: the load is queued for the next flush,
        the hash leaves this tier, its slot waits in quarantine until then."""
        slot = self._reserved.pop(h)
        self._loads.append((slot, entry))
        self._quarantine.append(slot)
        self.stats.promotions += 1
        self.stats.hits += 1
        self._removed([h])

    # ---- saves --------------------------------------------------------------------------------
    def save(self, entry: int, h: BlockHash) -> None:
        """Take in device entry ``entry`` that the checkpoint pool just evicted (still holding
        ``h``'s state until the next forward). Copied at the next flush; dropped and counted
        when every slot is reserved or quarantined."""
        if h in self:
            return
        slot = self._take_slot()
        if slot is None:
            self.stats.dropped += 1
            return
        self._saves[slot] = entry
        self._lru[h] = slot
        self.stats.stored += 1
        if self.on_stored is not None:
            self.on_stored([h])

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        if not self._lru:
            return None
        victim, slot = self._lru.popitem(last=False)
        self.stats.evictions += 1
        self._removed([victim])
        self._saves.pop(slot, None)  # saved and evicted before a flush: its copy is moot
        return slot

    def discard(self, hashes: Iterable[BlockHash]) -> None:
        """Drop hashes the device pool holds again (a checkpoint lives in one tier at a time)."""
        dropped = []
        for h in hashes:
            slot = self._lru.pop(h, None)
            if slot is not None:
                self._saves.pop(slot, None)
                self._quarantine.append(slot)
                dropped.append(h)
        self._removed(dropped)

    def _removed(self, hashes: list[BlockHash]) -> None:
        if hashes and self.on_removed is not None:
            self.on_removed(hashes)

    # ---- data movement ------------------------------------------------------------------------
    def flush(self, ckpt_conv: torch.Tensor, ckpt_ssm: torch.Tensor) -> None:
        """Apply pending saves out of, then pending loads into, the device entries
        (``ckpt_conv [L, N, ...]``, ``ckpt_ssm [L, N, ...]``; ``StatePool``'s checkpoint tensors)."""
        if self._saves:
            slots = torch.tensor(list(self._saves), dtype=torch.int64)
            ids = torch.tensor(list(self._saves.values()), dtype=torch.int64, device=ckpt_conv.device)
            self._saves.clear()
            self._copies.save([self.conv, self.ssm], [ckpt_conv.index_select(1, ids).movedim(1, 0),
                                                      ckpt_ssm.index_select(1, ids).movedim(1, 0)], slots)
        self._copies.wait()  # a promoted slot may have been saved this very step
        loads, self._loads = self._loads, []
        self._free.extend(self._quarantine)
        self._quarantine.clear()
        if not loads:
            return
        slots = torch.tensor([s for s, _ in loads], dtype=torch.int64)
        ids = torch.tensor([e for _, e in loads], dtype=torch.int64, device=ckpt_conv.device)
        dev = ckpt_conv.device
        ckpt_conv.index_copy_(1, ids, self.conv.index_select(0, slots).to(dev, non_blocking=True).movedim(0, 1))
        ckpt_ssm.index_copy_(1, ids, self.ssm.index_select(0, slots).to(dev, non_blocking=True).movedim(0, 1))

    def check_integrity(self) -> None:
        slots = list(self._lru.values()) + list(self._reserved.values()) + self._free + self._quarantine
        errors = []
        if sorted(slots) != list(range(self.num_slots)):
            errors.append(f"slots are not partitioned: {len(slots)} listed for {self.num_slots}")
        if self._lru.keys() & self._reserved.keys():
            errors.append("a hash is both evictable and reserved")
        if errors:
            raise KVIntegrityError("host checkpoint tier integrity violated: " + "; ".join(errors))
