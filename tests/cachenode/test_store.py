"""BlockStore alone: LRU order, the byte budget, idempotent puts, longest-prefix lookup, events."""

from __future__ import annotations

import numpy as np
import pytest

from kvmesh.engine.cachenode.store import WANTED, BlockStore
from kvmesh.engine.kv.events import BlockRemoved, BlockStored, KVEventLog
from kvmesh.engine.transfer.errors import HeaderMismatch
from kvmesh.engine.transfer.header import BlockBatch, BlockHeader
from kvmesh.engine.transfer.protocol import EXISTS, NO_ROOM, STORED, TOO_LARGE

from tests.support.kv_blocks import blocks, chain, layout

LAY = layout()  # 2 layers x 2 x 4 tokens x 3 heads x 8 dims x 2 bytes = 768 bytes a block
BLK = LAY.nbytes


def store_of(n_blocks: int, **kw) -> BlockStore:
    return BlockStore(n_blocks * BLK, **kw)


def put_all(store, blks):
    return [store.put(b.header, b.data) for b in blks]


def test_put_lookup_get_longest_prefix():
    s = store_of(10)
    blks, _ = blocks(LAY, 5)
    hashes = [b.block_hash for b in blks]
    assert put_all(s, blks[:3] + blks[4:]) == [STORED] * 4
    assert s.lookup(hashes) == 3
    assert s.lookup(hashes[3:]) == 0
    assert s.lookup([]) == 0
    assert [b.header for b in s.get(LAY, hashes)] == [b.header for b in blks[:3]]
    s.check_integrity()
    # Bytes in and out: every stored block once, every served block once.
    assert (s.stats.put_bytes, s.stats.hit_bytes) == (4 * BLK, 3 * BLK)


def test_lru_order_and_eviction_never_exceeds_budget():
    s = store_of(3)
    blks, _ = blocks(LAY, 6)
    h = [b.block_hash for b in blks]
    put_all(s, blks[:3])
    assert s.lru_order() == h[:3]
    s.lookup([h[0]])  # a probe is not a use
    assert s.lru_order() == h[:3]
    s.get(LAY, [h[0]])  # a read is
    assert s.lru_order() == [h[1], h[2], h[0]]
    for b in blks[3:]:
        assert s.put(b.header, b.data) == STORED
        assert s.used_bytes <= s.capacity_bytes
        s.check_integrity()
    assert s.lru_order() == h[3:]
    assert s.stats.evictions == 3


def test_idempotent_puts_and_concurrent_offers():
    s = store_of(4)
    blks, _ = blocks(LAY, 2)
    assert put_all(s, blks) == [STORED, STORED]
    assert put_all(s, blks) == [EXISTS, EXISTS]
    assert s.num_blocks == 2 and s.used_bytes == 2 * BLK
    # Two clients offer the same new block at once: only the first sends it.
    (new,), _ = blocks(LAY, 1, seed=7)
    batch = BlockBatch(LAY, [new.block_hash], [None])
    assert s.offer(batch) == [WANTED]
    assert s.offer(batch) == [EXISTS]
    assert s.lookup([new.block_hash]) == 0  # in flight is not stored
    assert s.commit(new.header, new.data) == STORED
    assert s.offer(batch) == [EXISTS]
    # Duplicates inside one batch are wanted once.
    (dup,), _ = blocks(LAY, 1, seed=9)
    assert s.offer(BlockBatch(LAY, [dup.block_hash] * 2, [None, None])) == [WANTED, EXISTS]
    s.abandon(dup.block_hash)
    s.check_integrity()


def test_reservations_count_against_the_budget():
    s = store_of(2)
    blks, _ = blocks(LAY, 3)
    batch = BlockBatch.of([b.header for b in blks])
    assert s.offer(batch) == [WANTED, WANTED, NO_ROOM]  # in-flight bytes are never evicted
    assert s.reserved_bytes == 2 * BLK
    s.check_integrity()
    s.abandon(blks[0].block_hash)
    s.abandon(blks[0].block_hash)  # idempotent
    assert s.commit(blks[1].header, blks[1].data) == STORED
    assert s.reserved_bytes == 0 and s.used_bytes == BLK
    with pytest.raises(KeyError):
        s.commit(blks[0].header, blks[0].data)  # abandoned: not stored
    s.check_integrity()


def test_block_larger_than_budget_is_refused():
    s = BlockStore(BLK - 1)
    (b,), _ = blocks(LAY, 1)
    assert s.put(b.header, b.data) == TOO_LARGE
    assert s.num_blocks == 0 and s.used_bytes == 0


def test_same_hash_other_layout_is_rejected():
    s = store_of(4)
    (b,), _ = blocks(LAY, 1)
    s.put(b.header, b.data)
    other = layout(layers=3)
    other = type(other)(extra_key=LAY.extra_key, dtype=LAY.dtype, block_size=LAY.block_size, num_layers=3,
                        num_kv_heads=LAY.num_kv_heads, head_dim=LAY.head_dim, buffers=other.buffers)
    with pytest.raises(HeaderMismatch) as e:
        s.put(BlockHeader(other, b.block_hash, None), np.zeros(other.nbytes, np.uint8))
    assert e.value.field == "num_layers"
    with pytest.raises(HeaderMismatch) as e:
        s.get(other, [b.block_hash])
    assert e.value.field == "num_layers"
    with pytest.raises(HeaderMismatch) as e:
        s.offer(BlockBatch(LAY, [b"short"], [None]))
    assert e.value.field == "block_hash"
    assert s.stats.rejected_headers == 3
    s.check_integrity()


def test_events_follow_the_contents():
    log = KVEventLog("node-a")
    s = store_of(2, on_event=log.publish)
    blks, _ = blocks(LAY, 3)
    put_all(s, blks)
    events = [r.event for r in log.since(0)]
    assert [type(e) for e in events] == [BlockStored, BlockStored, BlockRemoved, BlockStored]
    assert all(e.tier == "remote" for e in events)
    assert events[1].parent_hash == blks[0].block_hash
    assert events[2].block_hashes == [blks[0].block_hash]
    assert log.snapshot().hashes["remote"] == frozenset(s.lru_order())


def test_a_batch_commit_announces_one_removal_and_one_store_per_chain_run():
    log = KVEventLog("node-a")
    s = store_of(4, on_event=log.publish)
    old, _ = blocks(LAY, 2, seed=1)
    put_all(s, old)
    new, _ = blocks(LAY, 3, seed=2)
    stray, _ = blocks(LAY, 1, seed=3)  # not part of the chain: a run of its own
    batch = new + stray
    assert s.offer(BlockBatch.of([b.header for b in batch])) == [WANTED] * 4
    before = log.latest_seq
    assert s.commit_many([b.header for b in batch], [b.data for b in batch]) == [STORED] * 4
    events = [r.event for r in log.since(before)]
    assert [type(e) for e in events] == [BlockRemoved, BlockStored, BlockStored]
    assert events[0].block_hashes == [b.block_hash for b in old]
    assert events[1].block_hashes == [b.block_hash for b in new] and events[1].parent_hash is None
    assert events[2].block_hashes == [stray[0].block_hash]
    assert log.snapshot().hashes["remote"] == frozenset(s.lru_order())
    s.check_integrity()


def test_a_batch_larger_than_the_budget_announces_each_block_before_its_eviction():
    log = KVEventLog("node-a")
    s = store_of(2, on_event=log.publish, max_inflight_bytes=5 * BLK)
    blks, _ = blocks(LAY, 5)
    assert s.offer(BlockBatch.of([b.header for b in blks])) == [WANTED] * 5
    assert s.commit_many([b.header for b in blks], [b.data for b in blks]) == [STORED] * 5
    assert s.lru_order() == [b.block_hash for b in blks[3:]]
    # Replaying the events gives the contents: nothing evicted is announced as stored after it went.
    assert log.snapshot().hashes["remote"] == frozenset(s.lru_order())
    s.check_integrity()


def test_chain_helper_is_the_engine_hash():
    assert chain(LAY, 2) == [b.block_hash for b in blocks(LAY, 2)[0]]


def test_an_offer_evicts_nothing_and_a_commit_only_what_its_bytes_need():
    """An offer sized to the whole cache that never sends a byte costs the cache nothing."""
    s = store_of(4)
    old, _ = blocks(LAY, 4, seed=1)
    put_all(s, old)
    new, _ = blocks(LAY, 4, seed=2)
    assert s.offer(BlockBatch.of([b.header for b in new])) == [WANTED] * 4
    assert s.lru_order() == [b.block_hash for b in old] and s.stats.evictions == 0
    assert s.reserved_bytes == 4 * BLK and s.used_bytes == 4 * BLK  # in flight: memory, not the cache
    assert s.commit(new[0].header, new[0].data) == STORED
    assert s.lru_order() == [b.block_hash for b in old[1:]] + [new[0].block_hash]  # the LRU one, alone
    for b in new[1:]:
        s.abandon(b.block_hash)  # the sender died: the rest of the old blocks stay
    assert s.lookup([b.block_hash for b in old[1:]]) == 3
    s.check_integrity()


def test_in_flight_bytes_are_limited_in_all_and_per_offer():
    s = store_of(8, max_inflight_bytes=3 * BLK)
    blks, _ = blocks(LAY, 5)
    batch = BlockBatch.of([b.header for b in blks])
    assert s.offer(batch, max_bytes=2 * BLK) == [WANTED, WANTED, NO_ROOM, NO_ROOM, NO_ROOM]  # one connection's share
    rest = BlockBatch.of([b.header for b in blks[2:]])
    assert s.offer(rest) == [WANTED, NO_ROOM, NO_ROOM]  # the global limit: 3 blocks in flight
    assert s.reserved_bytes == 3 * BLK and s.stats.put_refused == 5
    s.check_integrity()
    with pytest.raises(ValueError, match="in-flight limit"):
        BlockStore(BLK, max_inflight_bytes=0)
