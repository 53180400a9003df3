"""BlockPool: ownership, LRU reuse, and prefix-cache semantics (hashes survive in the free queue)."""

from __future__ import annotations

import hashlib

import pytest

from kvmesh.engine.kv.block_pool import BlockPool, KVBlock, KVIntegrityError, NoFreeBlocksError
from kvmesh.engine.kv.events import AllBlocksCleared, BlockRemoved, BlockStored


def H(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


class Recorder(list):
    def __call__(self, event):
        self.append(event)


def make(n: int = 8, **kw) -> tuple[BlockPool, Recorder]:
    rec = Recorder()
    pool = BlockPool(n, on_event=rec, **kw)
    pool.check_integrity()
    return pool, rec


def compute_and_cache(pool: BlockPool, names: list[str], bs: int = 2) -> list[KVBlock]:
    """A request computes len(names) full blocks and registers them as one chain."""
    blocks = pool.allocate(len(names))
    pool.check_integrity()
    pool.cache_full_blocks(blocks, [H(n) for n in names], None, list(range(bs * len(names))))
    pool.check_integrity()
    return blocks


def lookup_prefix(pool: BlockPool, names: list[str]) -> list[KVBlock]:
    hits = []
    for n in names:
        b = pool.get_cached_block(H(n))
        if b is None:
            break
        hits.append(b)
    return hits


def test_fresh_pool_accounting():
    pool, _ = make(8)
    assert pool.num_free_blocks == 8 and pool.usage == 0.0 and pool.num_cached_blocks == 0
    blocks = pool.allocate(3)
    pool.check_integrity()
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.num_free_blocks == 5 and pool.usage == pytest.approx(3 / 8)
    pool.free(reversed(blocks))
    pool.check_integrity()
    assert pool.num_free_blocks == 8 and pool.usage == 0.0


def test_allocate_more_than_free_raises_and_changes_nothing():
    pool, _ = make(4)
    pool.allocate(3)
    with pytest.raises(NoFreeBlocksError, match="only 1 of 4"):
        pool.allocate(2)
    pool.check_integrity()
    assert pool.num_free_blocks == 1
    assert pool.allocate(0) == []
    with pytest.raises(ValueError):
        pool.allocate(-1)


def test_free_queue_is_lru():
    pool, _ = make(6)
    blocks = pool.allocate(6)
    a, b, c = blocks[0], blocks[3], blocks[5]
    names = {a: "a", b: "b", c: "c"}
    for blk, n in names.items():
        pool.cache_full_block(blk, H(n), None, [0, 0])
    pool.free([b])
    pool.free([c])
    pool.free([a])
    pool.check_integrity()
    # Least recently freed is reused (and evicted) first.
    assert [x.block_id for x in pool.allocate(1)] == [b.block_id]
    assert pool.get_cached_block(H("b")) is None
    assert pool.get_cached_block(H("c")) is c and pool.get_cached_block(H("a")) is a
    # The next two in LRU order are taken; a request gets them in ascending id order.
    assert [x.block_id for x in pool.allocate(2)] == sorted([c.block_id, a.block_id])
    pool.check_integrity()


def test_reverse_free_evicts_sequence_tail_first():
    pool, _ = make(4)
    blocks = compute_and_cache(pool, ["p0", "p1", "p2", "p3"])
    pool.free(reversed(blocks))
    pool.check_integrity()
    evicted = pool.allocate(1)[0]
    assert evicted is blocks[3]
    assert lookup_prefix(pool, ["p0", "p1", "p2", "p3"]) == blocks[:3]


def test_unhashed_free_blocks_are_reused_before_cached_content():
    pool, _ = make(4)
    blocks = pool.allocate(4)
    pool.cache_full_blocks(blocks[:2], [H("x0"), H("x1")], None, [0] * 4)
    pool.free(reversed(blocks))  # blocks[2:] hold no hash (a partial block, a scratch block)
    pool.check_integrity()
    got = pool.allocate(2)
    assert set(got) == {blocks[2], blocks[3]}
    assert pool.num_cached_blocks == 2
    pool.check_integrity()


def test_free_pool_hit_keeps_cache_entry_for_later_requests():
    """Regression: a hit on a free block must not reset it or drop its cache entry."""
    pool, rec = make(8)
    names = ["s0", "s1", "s2"]
    a_blocks = compute_and_cache(pool, names)          # request A computes
    pool.free(reversed(a_blocks))                      # ... and finishes
    pool.check_integrity()
    assert pool.num_free_blocks == 8 and pool.num_cached_blocks == 3

    b_hits = lookup_prefix(pool, names)                # request B hits from the free pool
    assert b_hits == a_blocks
    pool.touch(b_hits)
    pool.check_integrity()
    assert pool.num_free_blocks == 5
    assert [b.block_hash for b in b_hits] == [H(n) for n in names]
    assert all(pool.get_cached_block(H(n)) is blk for n, blk in zip(names, a_blocks))
    b_new = pool.allocate(5)                           # B fills the rest of the pool
    assert not set(b_new) & set(b_hits)
    pool.free(reversed(b_hits + b_new))                # B finishes
    pool.check_integrity()

    c_hits = lookup_prefix(pool, names)                # request C must still hit
    assert c_hits == a_blocks
    pool.touch(c_hits)
    pool.check_integrity()
    assert not any(isinstance(e, (BlockRemoved, AllBlocksCleared)) for e in rec)


def test_touch_in_use_block_shares_it():
    pool, _ = make(4)
    (blk,) = compute_and_cache(pool, ["t"])
    pool.touch([blk])
    pool.check_integrity()
    assert blk.ref_cnt == 2 and pool.num_free_blocks == 3
    pool.free([blk])
    assert blk.ref_cnt == 1 and pool.num_free_blocks == 3
    pool.free([blk])
    pool.check_integrity()
    assert pool.num_free_blocks == 4 and blk.block_hash == H("t")


def test_touch_free_block_removes_it_from_middle_of_queue():
    pool, _ = make(5)
    blocks = compute_and_cache(pool, ["m0", "m1", "m2", "m3", "m4"])
    pool.free(blocks)
    middle = blocks[2]
    pool.touch([middle])
    pool.check_integrity()
    assert middle.ref_cnt == 1 and middle.block_hash == H("m2")
    rest = pool.allocate(4)
    assert middle not in rest
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    pool.check_integrity()


def test_eviction_on_reuse_emits_removed_and_clears_hash():
    pool, rec = make(2)
    blocks = compute_and_cache(pool, ["e0", "e1"])
    pool.free(reversed(blocks))
    rec.clear()
    got = pool.allocate(2)
    pool.check_integrity()
    assert all(b.block_hash is None for b in got)
    assert pool.num_cached_blocks == 0
    assert rec == [BlockRemoved([H("e1"), H("e0")], "gpu")]


def test_duplicate_hash_keeps_first_mapping():
    pool, rec = make(4)
    (first,) = compute_and_cache(pool, ["dup"])
    (second,) = pool.allocate(1)
    rec.clear()
    pool.cache_full_block(second, H("dup"), None, [0, 0])
    pool.check_integrity()
    assert pool.get_cached_block(H("dup")) is first
    assert second.block_hash is None
    assert rec == []  # nothing new was cached
    # Freeing and reusing the unhashed duplicate must not disturb the cached one.
    pool.free([second])
    assert pool.allocate(1) == [second]
    assert pool.get_cached_block(H("dup")) is first
    pool.check_integrity()


def test_duplicate_inside_a_chain_segment():
    pool, rec = make(4)
    (x,) = compute_and_cache(pool, ["c1"])
    blocks = pool.allocate(3)
    rec.clear()
    pool.cache_full_blocks(blocks, [H("c0"), H("c1"), H("c2")], None, list(range(6)))
    pool.check_integrity()
    assert [b.block_hash for b in blocks] == [H("c0"), None, H("c2")]
    assert pool.get_cached_block(H("c1")) is x
    assert rec == [BlockStored([H("c0"), H("c1"), H("c2")], None, list(range(6)), 2, "gpu")]


def test_recaching_a_block_is_idempotent_but_rehashing_is_refused():
    pool, rec = make(2)
    (b,) = compute_and_cache(pool, ["r"])
    rec.clear()
    pool.cache_full_block(b, H("r"), None, [0, 0])
    assert rec == []
    with pytest.raises(KVIntegrityError, match="immutable"):
        pool.cache_full_block(b, H("other"), None, [0, 0])
    pool.check_integrity()


def test_caching_a_free_block_is_refused():
    pool, _ = make(2)
    with pytest.raises(KVIntegrityError, match="nobody holds"):
        pool.cache_full_block(pool.blocks[0], H("z"), None, [0, 0])
    pool.check_integrity()


def test_stored_event_fields_and_block_size_check():
    pool, rec = make(4, tier="cpu", block_size=2)
    blocks = pool.allocate(2)
    pool.cache_full_blocks(blocks, [H("f0"), H("f1")], H("parent"), [5, 6, 7, 8])
    assert rec == [BlockStored([H("f0"), H("f1")], H("parent"), [5, 6, 7, 8], 2, "cpu")]
    with pytest.raises(ValueError, match="block_size 2"):
        pool.cache_full_blocks(pool.allocate(1), [H("g")], None, [1, 2, 3])
    with pytest.raises(ValueError, match="do not split"):
        pool.cache_full_blocks(blocks, [H("f0"), H("f1")], None, [1, 2, 3])


def test_double_free_is_detected_before_any_change():
    pool, _ = make(4)
    a, b = pool.allocate(2)
    with pytest.raises(KVIntegrityError, match="more times"):
        pool.free([a, b, b])
    pool.check_integrity()
    assert a.ref_cnt == 1 and b.ref_cnt == 1
    pool.free([a])
    with pytest.raises(KVIntegrityError):
        pool.free([a])
    pool.check_integrity()


def test_reset_refused_while_in_use_then_clears():
    pool, rec = make(4)
    blocks = compute_and_cache(pool, ["z0", "z1"])
    rec.clear()
    assert pool.reset_prefix_cache() is False
    assert pool.num_cached_blocks == 2 and rec == []
    pool.free(reversed(blocks))
    assert pool.reset_prefix_cache() is True
    pool.check_integrity()
    assert pool.num_cached_blocks == 0
    assert all(b.block_hash is None for b in pool.blocks)
    assert lookup_prefix(pool, ["z0"]) == []
    assert rec == [AllBlocksCleared("gpu")]


def test_caching_disabled_never_caches():
    pool, rec = make(2, enable_caching=False)
    blocks = pool.allocate(2)
    pool.cache_full_blocks(blocks, [H("n0"), H("n1")], None, [0] * 4)
    assert pool.num_cached_blocks == 0 and pool.get_cached_block(H("n0")) is None
    assert rec == []
    pool.check_integrity()


def test_check_integrity_detects_corruption():
    pool, _ = make(4)
    blocks = compute_and_cache(pool, ["k0"])
    blocks[0].ref_cnt = 0  # in use per the queue, but claims to be free
    with pytest.raises(KVIntegrityError, match="appears 0 times"):
        pool.check_integrity()
    blocks[0].ref_cnt = 1
    pool.check_integrity()
    blocks[0].block_hash = H("wrong")
    with pytest.raises(KVIntegrityError, match="cache entry"):
        pool.check_integrity()
    blocks[0].block_hash = H("k0")
    pool.cached.pop(H("k0"))
    with pytest.raises(KVIntegrityError, match="missing from the cache map"):
        pool.check_integrity()
    pool.cached[H("k0")] = blocks[0]
    free_block = pool.blocks[3]
    free_block.ref_cnt = -1
    with pytest.raises(KVIntegrityError, match="negative"):
        pool.check_integrity()


def test_invalid_construction():
    with pytest.raises(ValueError):
        BlockPool(0)
    with pytest.raises(ValueError, match="tier"):
        BlockPool(1, tier="disk")
