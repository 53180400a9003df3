"""Content-addressed recurrent-state checkpoints of hybrid models: the index and the policy.

A checkpoint is the DeltaNet state (every layer's conv and recurrent state) of a sequence at a
block boundary, keyed by the chain hash of the block that ends there: the same hash chain as
the KV blocks, so the model identity, dtype and cache salt are in it. Entries live in a fixed
pool of equal-size slots (the tensors are the runner's ``StatePool.ckpt_*``); this module
keeps the bookkeeping: which entry holds which hash, least-recently-used eviction, pins.

An entry is *free*, *reserved* (a step is writing it, or a request keeps its latest
generation-region state there until it finishes) or *published* (indexed by hash, evictable
unless pinned by a restore in flight).

Two optional hooks tell the outside which hashes have a checkpoint: ``on_publish(h)`` when a hash
becomes indexed (not for a duplicate of a hash already held) and ``on_evict(h)`` when its entry
is reused; between the two calls for ``h``, ``h in index`` holds. The engine turns them into KV
events (engine/kv/events.py, the ``state-*`` media).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from kvmesh.engine.block_hash import BlockHash


@dataclass
class CheckpointStats:
    """Cumulative counters of one checkpoint pool (entries, not bytes; ``entry_bytes`` converts)."""

    capacity: int = 0
    entry_bytes: int = 0
    published: int = 0  # entries now indexed by hash
    saves: int = 0  # captures published (duplicates of a hash already held not counted)
    restores: int = 0  # prefix hits resumed from a checkpoint
    evictions: int = 0
    reserve_failures: int = 0  # a capture skipped: every entry reserved or pinned


class CheckpointIndex:
    """hash -> entry over ``capacity`` entries with LRU eviction of unpinned published ones."""

    def __init__(self, capacity: int, entry_bytes: int = 0,
                 on_publish: Callable[[BlockHash], None] | None = None,
                 on_evict: Callable[[int, BlockHash], None] | None = None) -> None:
        """``on_publish(hash)``: a hash became indexed. ``on_evict(entry, hash)``: ``reserve``
        evicted a published entry, which still holds that hash's state (a lower tier copies it
        out before the next forward). Either may be replaced later (the attributes of the same
        names): the host tier chains itself in front of the engine's event hook."""
        if capacity < 1:
            raise ValueError(f"a checkpoint pool needs at least one entry, got {capacity}")
        self.capacity = capacity
        self._free = list(range(capacity - 1, -1, -1))
        self._by_hash: OrderedDict[BlockHash, int] = OrderedDict()  # LRU order: oldest first
        self._hash_of: dict[int, BlockHash] = {}
        self._pins: dict[int, int] = {}
        self._reserved: set[int] = set()
        self.stats = CheckpointStats(capacity=capacity, entry_bytes=entry_bytes)
        self.on_publish = on_publish
        self.on_evict = on_evict

    def __contains__(self, h: BlockHash) -> bool:
        return h in self._by_hash

    def lookup(self, h: BlockHash) -> int | None:
        """The entry holding ``h`` (marked recently used), or None."""
        idx = self._by_hash.get(h)
        if idx is not None:
            self._by_hash.move_to_end(h)
        return idx

    def pin(self, idx: int) -> None:
        self._pins[idx] = self._pins.get(idx, 0) + 1

    def unpin(self, idx: int) -> None:
        n = self._pins.get(idx, 0) - 1
        if n < 0:
            raise ValueError(f"checkpoint entry {idx} is not pinned")
        if n:
            self._pins[idx] = n
        else:
            del self._pins[idx]

    def reserve(self) -> int | None:
        """A writable entry: a free one, else the least recently used unpinned published one
        (evicted); None when every entry is reserved or pinned."""
        if self._free:
            idx = self._free.pop()
        else:
            victim = next((h for h, i in self._by_hash.items() if i not in self._pins), None)
            if victim is None:
                self.stats.reserve_failures += 1
                return None
            idx = self._by_hash.pop(victim)
            del self._hash_of[idx]
            self.stats.evictions += 1
            if self.on_evict is not None:
                self.on_evict(idx, victim)
        self._reserved.add(idx)
        return idx

    def release(self, idx: int) -> None:
        """Give back a reserved entry unpublished (its step failed, or it was superseded)."""
        self._reserved.remove(idx)
        self._free.append(idx)

    def publish(self, idx: int, h: BlockHash) -> None:
        """Index reserved entry ``idx`` under ``h``; if ``h`` is already held, ``idx`` is freed
        instead (same hash, same state: content addressing needs only one copy)."""
        self._reserved.remove(idx)
        if h in self._by_hash:
            self._by_hash.move_to_end(h)
            self._free.append(idx)
            return
        self._by_hash[h] = idx
        self._hash_of[idx] = h
        self.stats.saves += 1
        if self.on_publish is not None:
            self.on_publish(h)

    def lookup_entry(self, h: BlockHash) -> int | None:
        """The entry holding ``h``, without touching the LRU order."""
        return self._by_hash.get(h)

    def hashes(self) -> set[BlockHash]:
        """The published hashes."""
        return set(self._by_hash)

    def snapshot(self) -> CheckpointStats:
        return CheckpointStats(**{**self.stats.__dict__, "published": len(self._by_hash)})

    def check_integrity(self) -> None:
        published = set(self._by_hash.values())
        parts = [set(self._free), self._reserved, published]
        total = sum(len(p) for p in parts)
        if total != self.capacity or set().union(*parts) != set(range(self.capacity)):
            raise AssertionError(f"checkpoint entries inconsistent: free {len(self._free)}, reserved "
                                 f"{len(self._reserved)}, published {len(published)}, capacity {self.capacity}")
        if any(self._hash_of[i] != h for h, i in self._by_hash.items()):
            raise AssertionError("checkpoint hash index and entry table disagree")


def restorable_blocks(hashes: Sequence[BlockHash], num_kv_blocks: int,
                      has_checkpoint: Callable[[BlockHash], bool]) -> int:
    """What a hybrid prefix hit can use of ``num_kv_blocks`` leading cached KV blocks: the longest
    ``j <= num_kv_blocks`` whose block ``j - 1`` has a checkpoint (0: none). The engine's
    admission and the router's prediction (engine/router/index.py) both decide with this
    function, so they agree whenever they see the same index. Pure function.
    """
    for j in range(num_kv_blocks, 0, -1):
        if has_checkpoint(hashes[j - 1]):
            return j
    return 0


def capture_points(start: int, end: int, num_prompt_tokens: int, block_size: int,
                   interval: int, wanted: Collection[int] = ()) -> tuple[list[int], int | None]:
    """Block boundaries in ``(start, end]`` to checkpoint when a step computes tokens [start, end).

    Returns (published, pending): ``published`` are the boundaries published as soon as the step
    is done: multiples of ``interval`` (0: none), the ``wanted`` boundaries (where later prompts
    are expected to diverge: chat message ends, branch points) and the prompt's last boundary a
    repeat of the prompt can hit (``(num_prompt_tokens - 1) // block_size`` blocks). ``pending`` is the last
    boundary past that one that is not itself published: the request keeps the state there and
    publishes it when it finishes, so a finished turn leaves a restore point at its end.
    Pure function.
    """
    bs = block_size
    prompt_end = (num_prompt_tokens - 1) // bs * bs
    published: list[int] = []
    pending: int | None = None
    first = (start // bs + 1) * bs
    for b in range(first, end + 1, bs):
        if (interval and b % interval == 0) or b == prompt_end or b in wanted:
            published.append(b)
            if b > prompt_end:
                pending = None  # a later published point supersedes the held one
        elif b > prompt_end:
            pending = b
    return published, pending


class BranchPoints:
    """Block ends where cached prompts were seen to diverge, most recent last, at most ``capacity``.

    A hybrid prefix hit is cut back to its last checkpoint; when it was cut back, the KV match
    ended where the new prompt left an older one, and no checkpoint was taken there (it was
    nobody's block boundary of interest then). Remembering that block's hash lets the next prompt
    that computes through it capture there, so the third prompt sharing a prefix resumes from it.
    Hashes only: a branch point costs a checkpoint entry only when a prompt crosses it.
    """

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._hashes: OrderedDict[BlockHash, None] = OrderedDict()

    def __contains__(self, h: BlockHash) -> bool:
        return h in self._hashes

    def __len__(self) -> int:
        return len(self._hashes)

    def add(self, h: BlockHash) -> tuple[bool, BlockHash | None]:
        """Remember ``h``: (whether it is new, the oldest branch point it displaced, if any)."""
        if h in self._hashes:
            self._hashes.move_to_end(h)
            return False, None
        self._hashes[h] = None
        if len(self._hashes) > self.capacity:
            return True, self._hashes.popitem(last=False)[0]
        return True, None


def wanted_boundaries(hashes: Sequence[BlockHash], start: int, end: int, block_size: int,
                      branches: BranchPoints, hints: Sequence[int] = ()) -> set[int]:
    """The block boundaries in ``(start, end]`` worth a checkpoint for one sequence: those whose
    block (``hashes[b // block_size - 1]``, the sequence's chain) is a branch point, and the
    boundary at or before each token position in ``hints``. Pure function."""
    bs = block_size
    out = {p // bs * bs for p in hints if start < p // bs * bs <= end}
    if len(branches):
        first, last = start // bs + 1, min(end // bs, len(hashes))
        out.update(j * bs for j in range(first, last + 1) if hashes[j - 1] in branches)
    return out
