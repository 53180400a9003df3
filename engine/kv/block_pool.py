"""Block pool: ownership, reuse order and the prefix-cache map of one tier's KV blocks.

A block is an index into the KV tensors held elsewhere; this module only decides who owns
which index and which content hash each index still holds.

Invariants (``check_integrity`` verifies them all):

* Every block is either in use (``ref_cnt > 0``, not in the free queue) or free
  (``ref_cnt == 0``, in the free queue exactly once).
* ``cached`` maps a hash to the one block holding that content, and that block's
  ``block_hash`` equals the key. A block with a hash is always in ``cached``; two blocks never
  share a hash (the second copy of some content stays unhashed).
* A block keeps its hash while it is free. A prefix hit on a free block (``touch``) takes it
  out of the free queue and leaves hash and ``cached`` entry alone. The hash is dropped only
  when ``allocate`` reuses the block for new content, or by ``reset_prefix_cache``.
* ``parent_hash`` is set exactly while ``block_hash`` is (None for a chain's first block).
* ``on_evict``, when given, sees every block ``allocate`` evicts, with its id, hash and parent
  still readable and its content not yet overwritten (the caller copies it to a lower tier
  before the step's forward pass writes the block), after the ``BlockRemoved`` event.

Every public operation costs O(blocks it is given or returns); nothing scans the pool except
``check_integrity`` (debug only).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvmesh.engine.block_hash import BlockHash
from .events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventHandler, TIER_GPU, check_tier


class NoFreeBlocksError(RuntimeError):
    """More blocks were requested than are free; callers check ``num_free_blocks`` first."""


class KVIntegrityError(RuntimeError):
    """The pool's bookkeeping is inconsistent (a double free, a corrupted queue, ...)."""


@dataclass(eq=False, slots=True)
class KVBlock:
    """One KV block. Identity matters: two KVBlock objects are never equal unless they are the same."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # Hash of the block before this one in its chain (None at the root), kept with block_hash.
    parent_hash: BlockHash | None = None
    # Free-queue links; both None exactly when the block is not in the free queue.
    prev_free: KVBlock | None = field(default=None, repr=False)
    next_free: KVBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked list of free blocks in eviction order: the head is reused first.

    Sentinel nodes at both ends keep insert/remove branch-free; every operation is O(1).
    """

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.size = 0
        for b in blocks:
            self.append(b)

    def _link_after(self, anchor: KVBlock, block: KVBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise KVIntegrityError(f"block {block.block_id} is already in the free queue")
        nxt = anchor.next_free
        assert nxt is not None
        block.prev_free, block.next_free = anchor, nxt
        anchor.next_free = block
        nxt.prev_free = block
        self.size += 1

    def append(self, block: KVBlock) -> None:
        """Insert at the tail: reused last."""
        prev = self._tail.prev_free
        assert prev is not None
        self._link_after(prev, block)

    def appendleft(self, block: KVBlock) -> None:
        """Insert at the head: reused first."""
        self._link_after(self._head, block)

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise KVIntegrityError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.size -= 1

    def popleft(self) -> KVBlock:
        first = self._head.next_free
        if first is self._tail or first is None:
            raise NoFreeBlocksError("the free block queue is empty")
        self.remove(first)
        return first

    def __len__(self) -> int:
        return self.size

    def __iter__(self):
        """Head to tail. Stops after ``limit`` steps so a corrupted (cyclic) list cannot hang."""
        node = self._head.next_free
        limit = self.size + 1
        while node is not None and node is not self._tail and limit > 0:
            yield node
            node = node.next_free
            limit -= 1


EvictHandler = Callable[[list[KVBlock]], None]
"""Called with the blocks one ``allocate`` evicts (hash and parent still set, content intact)."""


class BlockPool:
    """The blocks of one KV tier with an LRU free queue and a content-hash map.

    ``tier`` labels emitted events ("gpu" for the engine's primary pool). ``block_size``, when
    given, is checked against the token counts passed to ``cache_full_blocks``.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 on_event: KVEventHandler | None = None, tier: str = TIER_GPU,
                 block_size: int | None = None, on_evict: EvictHandler | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least 1 block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.on_event = on_event
        self.tier = check_tier(tier)
        self.block_size = block_size
        self.on_evict = on_evict
        self.blocks: list[KVBlock] = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0, including those still holding a cached hash."""
        return self.free_queue.size

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (0..1)."""
        return 1.0 - self.free_queue.size / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        """The block holding ``block_hash``, free or in use; None on a miss. Changes nothing."""
        if not self.enable_caching:
            return None
        return self.cached.get(block_hash)

    # -------------------------------------------------------------- ownership
    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on each block (prefix hits). A free block leaves the free queue
        with its hash and cache entry intact."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1

    def allocate(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the head of the free queue, each with ref_cnt 1 and no hash.

        A popped block that still held cached content is evicted here: its hash leaves
        ``cached`` and one ``BlockRemoved`` event lists all hashes evicted by this call.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > self.free_queue.size:
            raise NoFreeBlocksError(
                f"requested {n} KV blocks but only {self.free_queue.size} of {self.num_blocks} are free")
        out: list[KVBlock] = []
        evicted: list[KVBlock] = []
        for _ in range(n):
            b = self.free_queue.popleft()
            if b.block_hash is not None:
                if self.cached.get(b.block_hash) is b:
                    del self.cached[b.block_hash]
                evicted.append(b)
            b.ref_cnt = 1
            out.append(b)
        if evicted:
            self._emit(BlockRemoved([b.block_hash for b in evicted], self.tier))
            if self.on_evict is not None:
                self.on_evict(evicted)
            for b in evicted:
                b.block_hash = b.parent_hash = None
        # Which blocks are taken is the queue's choice; which position each serves is not, and
        # ascending ids make a request's blocks consecutive runs (freed in reverse, they come
        # back descending), so loading a fetch into them is a few slice copies (gather.py).
        out.sort(key=lambda b: b.block_id)
        return out

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference per listed block; blocks reaching 0 join the free queue.

        Pass a request's blocks in reverse order: a hashed block goes to the tail, so the
        end of a sequence (least likely shared) is evicted before its beginning. A block
        without a hash holds nothing reusable and goes to the head, to be reused before any
        cached content is evicted. Validates every block before changing anything.
        """
        blocks = list(blocks)
        drops: dict[int, int] = {}
        for b in blocks:
            drops[b.block_id] = drops.get(b.block_id, 0) + 1
            if drops[b.block_id] > b.ref_cnt:
                raise KVIntegrityError(
                    f"freeing block {b.block_id} more times than it is referenced (ref_cnt {b.ref_cnt}); "
                    f"a request released a block twice")
        for b in blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if b.block_hash is None:
                    self.free_queue.appendleft(b)
                else:
                    self.free_queue.append(b)

    # ----------------------------------------------------------------- caching
    def cache_full_block(self, block: KVBlock, block_hash: BlockHash, parent_hash: BlockHash | None,
                         token_ids: Sequence[int]) -> None:
        """Register one computed full block under ``block_hash`` (see ``cache_full_blocks``)."""
        self.cache_full_blocks([block], [block_hash], parent_hash, token_ids)

    def cache_full_blocks(self, blocks: Sequence[KVBlock], block_hashes: Sequence[BlockHash],
                          parent_hash: BlockHash | None, token_ids: Sequence[int]) -> None:
        """Register consecutive computed full blocks of one sequence so later requests can hit them.

        ``block_hashes[i]`` names ``blocks[i]``; ``parent_hash`` is the hash of the block before
        ``blocks[0]`` (None at the root); ``token_ids`` are the listed blocks' tokens, concatenated.
        If another block already holds a hash, that mapping stays and this block stays
        unhashed, so identical content never aliases one entry. One ``BlockStored`` event
        lists the whole segment (every hash in it is cached once this returns), emitted only if
        some hash was new. No-op when caching is disabled.
        """
        if len(blocks) != len(block_hashes):
            raise ValueError(f"{len(blocks)} blocks but {len(block_hashes)} hashes")
        if not blocks or not self.enable_caching:
            return
        if len(token_ids) % len(blocks):
            raise ValueError(f"{len(token_ids)} tokens do not split evenly into {len(blocks)} full blocks")
        block_size = len(token_ids) // len(blocks)
        if self.block_size is not None and block_size != self.block_size:
            raise ValueError(f"blocks of {block_size} tokens given to a pool with block_size {self.block_size}")
        for b, h in zip(blocks, block_hashes):
            if b.ref_cnt < 1:
                raise KVIntegrityError(f"caching block {b.block_id} that nobody holds (ref_cnt {b.ref_cnt})")
            if b.block_hash is not None and b.block_hash != h:
                raise KVIntegrityError(
                    f"block {b.block_id} already holds hash {b.block_hash.hex()[:16]}, cannot re-cache it "
                    f"as {h.hex()[:16]}; cached blocks are immutable")
        new = False
        parent = parent_hash
        for b, h in zip(blocks, block_hashes):
            prev, parent = parent, h
            if b.block_hash is not None or h in self.cached:
                continue  # already this block's hash, or a duplicate of another block's content
            b.block_hash = h
            b.parent_hash = prev
            self.cached[h] = b
            new = True
        if new:
            self._emit(BlockStored(list(block_hashes), parent_hash, list(token_ids), block_size, self.tier))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (returns False) while any block is in use, since a
        running request's blocks would otherwise lose their identity mid-flight."""
        if self.free_queue.size != self.num_blocks:
            return False
        for b in self.cached.values():
            b.block_hash = b.parent_hash = None
        self.cached.clear()
        self._emit(AllBlocksCleared(self.tier))
        return True

    def _emit(self, event: KVEvent) -> None:
        if self.on_event is not None:
            self.on_event(event)

    # ------------------------------------------------------------------- debug
    def check_integrity(self) -> None:
        """Raise KVIntegrityError listing every violated invariant (O(num_blocks); tests/debug)."""
        errors: list[str] = []
        seen: dict[int, int] = {}
        walked = 0
        for b in self.free_queue:
            walked += 1
            seen[b.block_id] = seen.get(b.block_id, 0) + 1
            if not (0 <= b.block_id < self.num_blocks) or self.blocks[b.block_id] is not b:
                errors.append(f"free queue holds a foreign block {b.block_id}")
        if walked != self.free_queue.size:
            errors.append(f"free queue size {self.free_queue.size} but {walked} linked blocks")
        in_use = 0
        for b in self.blocks:
            count = seen.get(b.block_id, 0)
            if b.ref_cnt < 0:
                errors.append(f"block {b.block_id} has negative ref_cnt {b.ref_cnt}")
            elif b.ref_cnt > 0:
                in_use += 1
                if count or b.prev_free is not None or b.next_free is not None:
                    errors.append(f"block {b.block_id} is in use (ref_cnt {b.ref_cnt}) but in the free queue")
            elif count != 1:
                errors.append(f"free block {b.block_id} appears {count} times in the free queue")
            if b.block_hash is not None and self.cached.get(b.block_hash) is not b:
                errors.append(f"block {b.block_id} holds hash {b.block_hash.hex()[:16]} missing from the cache map")
        if in_use + self.free_queue.size != self.num_blocks:
            errors.append(f"{in_use} in use + {self.free_queue.size} free != {self.num_blocks} blocks")
        for h, b in self.cached.items():
            if b.block_hash != h:
                got = b.block_hash.hex()[:16] if b.block_hash else None
                errors.append(f"cache entry {h.hex()[:16]} points to block {b.block_id} holding {got}")
        if not self.enable_caching and self.cached:
            errors.append(f"caching is disabled but {len(self.cached)} blocks are cached")
        if errors:
            raise KVIntegrityError("block pool integrity violated: " + "; ".join(errors))
