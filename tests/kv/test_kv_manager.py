"""KVCacheManager (per-request block tables, prefix hits, admission) and KVEventLog."""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field

import pytest

from kvmesh.engine.block_hash import extra_key, hash_blocks
from kvmesh.engine.kv.block_pool import KVIntegrityError
from kvmesh.engine.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventLog,
)
from kvmesh.engine.kv.kv_manager import KVCacheManager

EXTRA = extra_key("test-model", "bfloat16")


def make(num_blocks: int = 16, block_size: int = 4, caching: bool = True, log: KVEventLog | None = None):
    kv = KVCacheManager(num_blocks, block_size, caching, EXTRA, on_event=log.publish if log else None)
    kv.check_integrity()
    return kv


def prefill(kv: KVCacheManager, rid: str, tokens: list[int]) -> tuple[int, list[int]]:
    """Admit a request in one step and 'compute' its prompt; returns (hit tokens, block ids)."""
    hits, n = kv.get_computed_blocks(rid, tokens)
    new = kv.allocate_slots(rid, tokens, len(tokens) - n, hits, n)
    assert new is not None
    kv.record_prefix_lookup(len(tokens), n)  # as the scheduler does on admission
    kv.check_integrity()
    kv.cache_blocks(rid, tokens, len(tokens))
    kv.check_integrity()
    return n, kv.block_ids(rid)


# ------------------------------------------------------------------ accounting

def test_blocks_needed_is_ceil():
    kv = make(block_size=4)
    assert [kv.num_blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocation_and_free_accounting():
    kv = make(num_blocks=8, block_size=4)
    new = kv.allocate_slots("a", list(range(10)), 10)
    kv.check_integrity()
    assert len(new) == 3 and kv.num_free_blocks == 5 and kv.usage == pytest.approx(3 / 8)
    assert kv.block_ids("a") == [b.block_id for b in new]
    # Decoding: token 11 and 12 fit in the third block, token 13 needs a fourth.
    assert kv.allocate_slots("a", list(range(11)), 1, num_computed_tokens=10) == []
    assert kv.allocate_slots("a", list(range(12)), 1, num_computed_tokens=11) == []
    got = kv.allocate_slots("a", list(range(13)), 1, num_computed_tokens=12)
    assert got is not None and len(got) == 1
    kv.check_integrity()
    assert len(kv.block_ids("a")) == 4 and kv.num_free_blocks == 4
    kv.free("a")
    kv.check_integrity()
    assert kv.num_free_blocks == 8 and kv.block_ids("a") == []
    kv.free("a")  # idempotent
    kv.free("never-seen")
    kv.check_integrity()


def test_allocation_that_does_not_fit_changes_nothing():
    kv = make(num_blocks=4, block_size=4)
    assert kv.allocate_slots("a", list(range(12)), 12) is not None
    assert kv.allocate_slots("b", list(range(8)), 8) is None
    kv.check_integrity()
    assert kv.num_free_blocks == 1 and "b" not in kv.requests
    assert kv.allocate_slots("a", list(range(17)), 5, num_computed_tokens=12) is None
    assert len(kv.block_ids("a")) == 3
    kv.check_integrity()


# ------------------------------------------------------------------ prefix hits

@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_prefix_hit_across_requests(block_size):
    kv = make(num_blocks=64, block_size=block_size)
    shared = list(range(1000, 1000 + 3 * block_size))
    a_tokens = shared + [1, 2]
    n, a_ids = prefill(kv, "a", a_tokens)
    assert n == 0
    b_tokens = shared + [7, 8, 9]
    hits, n = kv.get_computed_blocks("b", b_tokens)
    assert n == 3 * block_size
    assert [b.block_id for b in hits] == a_ids[:3]
    assert [b.block_hash for b in hits] == hash_blocks(b_tokens, block_size, EXTRA)[:3]
    assert kv.prefix_stats().queries == len(a_tokens), "a lookup alone is not an admission"
    kv.allocate_slots("b", b_tokens, len(b_tokens) - n, hits, n)
    kv.record_prefix_lookup(len(b_tokens), n)
    kv.check_integrity()
    assert kv.block_ids("b")[:3] == a_ids[:3]
    assert all(kv.pool.blocks[i].ref_cnt == 2 for i in a_ids[:3])
    stats = kv.prefix_stats()
    assert stats.queries == len(a_tokens) + len(b_tokens)
    assert stats.hits == 3 * block_size
    assert stats.hit_rate == pytest.approx(stats.hits / stats.queries)


def test_hit_after_owner_finished_survives_for_a_third_request():
    """Regression: a free-pool hit must keep the cache entry for requests after it."""
    kv = make(num_blocks=6, block_size=4)
    prompt = list(range(50, 62))  # 3 full blocks
    _, a_ids = prefill(kv, "a", prompt + [0])
    kv.free("a")
    n_b, b_ids = prefill(kv, "b", prompt + [1])
    assert n_b == 12 and b_ids[:3] == a_ids[:3]
    kv.free("b")
    n_c, c_ids = prefill(kv, "c", prompt + [2])
    assert n_c == 12 and c_ids[:3] == a_ids[:3]
    assert kv.prefix_stats().hits == 24
    kv.check_integrity()


def test_hit_capped_to_leave_one_token():
    kv = make(num_blocks=16, block_size=4)
    tokens = list(range(8))
    prefill(kv, "a", tokens + [99])
    _, n = kv.get_computed_blocks("b", tokens)  # fully cached, but one token must be computed
    assert n == 4
    _, n = kv.get_computed_blocks("c", tokens + [5])
    assert n == 8
    _, n = kv.get_computed_blocks("d", tokens[:1])
    assert n == 0
    assert kv.get_computed_blocks("e", []) == ([], 0)


def test_free_evicts_end_of_sequence_first():
    kv = make(num_blocks=4, block_size=4)
    prompt = list(range(12))
    _, a_ids = prefill(kv, "a", prompt + [5])  # 3 cached blocks + 1 partial
    kv.free("a")
    # The partial block holds nothing reusable; the next victim is the last full block.
    got = kv.allocate_slots("x", list(range(100, 108)), 8)
    assert sorted(b.block_id for b in got) == sorted([a_ids[3], a_ids[2]])
    _, n = kv.get_computed_blocks("b", prompt + [6])
    assert n == 8
    kv.check_integrity()


def test_recomputed_duplicate_block_stays_private():
    kv = make(num_blocks=16, block_size=4)
    tokens = list(range(8))
    _, a_ids = prefill(kv, "a", tokens + [99])
    n, b_ids = prefill(kv, "b", tokens)  # hit capped to one block: block 2 is recomputed
    assert n == 4 and b_ids[0] == a_ids[0] and b_ids[1] != a_ids[1]
    assert kv.pool.blocks[b_ids[1]].block_hash is None  # the cache keeps A's copy
    assert kv.pool.get_cached_block(kv.block_hashes("b")[1]).block_id == a_ids[1]
    kv.free("a")
    kv.free("b")
    kv.check_integrity()


def test_admission_counts_hit_blocks_taken_from_free_queue():
    kv = make(num_blocks=6, block_size=4)
    prompt = list(range(8))
    prefill(kv, "a", prompt + [42])   # blocks: 2 cached + 1 partial
    kv.free("a")
    assert kv.allocate_slots("filler", list(range(500, 512)), 12) is not None  # 3 blocks
    # Free: 3 blocks, 2 of them A's cached prefix. B hits those 2 and needs 2 more (16 tokens).
    b_tokens = prompt + list(range(100, 108))
    hits, n = kv.get_computed_blocks("b", b_tokens)
    assert n == 8 and kv.num_free_blocks == 3
    # Naive check (2 needed <= 3 free) would admit; taking the hits leaves only 1.
    assert kv.allocate_slots("b", b_tokens, len(b_tokens) - n, hits, n) is None
    kv.check_integrity()
    assert kv.num_free_blocks == 3 and all(b.ref_cnt == 0 for b in hits)
    assert kv.block_ids("b") == []
    # One block less needed: fits exactly.
    b_short = prompt + list(range(100, 103))
    hits, n = kv.get_computed_blocks("b2", b_short)
    new = kv.allocate_slots("b2", b_short, len(b_short) - n, hits, n)
    assert new is not None and len(new) == 1 and kv.num_free_blocks == 0
    kv.check_integrity()


def test_hits_already_in_use_do_not_reduce_free_count():
    kv = make(num_blocks=5, block_size=4)
    prompt = list(range(8))
    prefill(kv, "a", prompt + [1])     # 3 blocks in use, A keeps running
    b_tokens = prompt + list(range(10, 18))
    hits, n = kv.get_computed_blocks("b", b_tokens)
    assert n == 8 and kv.num_free_blocks == 2
    new = kv.allocate_slots("b", b_tokens, len(b_tokens) - n, hits, n)
    assert new is not None and len(new) == 2 and kv.num_free_blocks == 0
    kv.check_integrity()


def test_stale_hit_is_rejected():
    kv = make(num_blocks=3, block_size=4)
    prompt = list(range(8))
    prefill(kv, "a", prompt + [1])
    kv.free("a")
    hits, n = kv.get_computed_blocks("b", prompt + [2])
    kv.allocate_slots("other", list(range(100, 112)), 12)  # evicts everything
    with pytest.raises(ValueError, match="no longer holds"):
        kv.allocate_slots("b", prompt + [2], 1, hits, n)
    kv.check_integrity()


def test_later_call_must_pass_running_computed_count():
    kv = make(block_size=4)
    prefill(kv, "a", list(range(9)))
    with pytest.raises(ValueError, match="running computed-token count"):
        kv.allocate_slots("a", list(range(10)), 1)


def test_cache_blocks_incremental_while_decoding():
    log = KVEventLog("e", capacity=100)
    kv = make(num_blocks=16, block_size=4, log=log)
    tokens = [7, 7, 7]
    kv.allocate_slots("a", tokens, 3)
    kv.cache_blocks("a", tokens, 3)
    assert kv.num_cached_blocks("a") == 0 and log.latest_seq == 0
    computed = 3
    rng = random.Random(1)
    while len(tokens) < 14:
        tokens.append(rng.randrange(100))  # sampled; its KV is computed next step
        assert kv.allocate_slots("a", tokens, 1, num_computed_tokens=computed) is not None
        computed += 1
        kv.cache_blocks("a", tokens, computed)
        kv.check_integrity()
        assert kv.num_cached_blocks("a") == computed // 4
    expected = hash_blocks(tokens, 4, EXTRA)
    assert kv.block_hashes("a") == expected
    events = [r.event for r in log.since(0)]
    assert events == [
        BlockStored([expected[0]], None, tokens[0:4], 4, "gpu"),
        BlockStored([expected[1]], expected[0], tokens[4:8], 4, "gpu"),
        BlockStored([expected[2]], expected[1], tokens[8:12], 4, "gpu"),
    ]
    assert [kv.pool.blocks[i].block_hash for i in kv.block_ids("a")] == expected + [None]


def test_caching_disabled():
    kv = make(num_blocks=8, block_size=4, caching=False)
    prefill(kv, "a", list(range(9)))
    kv.free("a")
    assert kv.get_computed_blocks("b", list(range(9))) == ([], 0)
    assert kv.pool.num_cached_blocks == 0 and kv.prefix_stats().queries == 0
    kv.check_integrity()


def test_reset_prefix_cache_through_manager():
    log = KVEventLog("e")
    kv = make(num_blocks=8, block_size=4, log=log)
    prefill(kv, "a", list(range(9)))
    assert kv.reset_prefix_cache() is False
    kv.free("a")
    assert kv.reset_prefix_cache() is True
    assert kv.get_computed_blocks("b", list(range(9)))[1] == 0
    assert isinstance(log.since(log.latest_seq - 1)[0].event, AllBlocksCleared)
    assert log.snapshot().hashes["gpu"] == frozenset()


def test_check_integrity_detects_reference_mismatch():
    kv = make(num_blocks=4, block_size=4)
    prefill(kv, "a", list(range(5)))
    kv.pool.touch([kv.requests["a"].blocks[0]])  # a reference no request accounts for
    with pytest.raises(KVIntegrityError, match="request references"):
        kv.check_integrity()


# ------------------------------------------------------------------ event log

def test_event_log_sequence_gap_and_snapshot():
    clock = iter(range(100, 200))
    log = KVEventLog("engine-7", capacity=3, clock=lambda: float(next(clock)))
    h = [bytes([i]) * 32 for i in range(4)]
    assert log.since(0) == [] and log.snapshot().seq == 0
    log.publish(BlockStored([h[0], h[1]], None, [1, 2], 1, "gpu"))
    log.publish(BlockStored([h[2]], None, [3], 1, "cpu"))
    recs = log.since(0)
    assert [r.seq for r in recs] == [1, 2]
    assert recs[0].engine_id == "engine-7" and recs[0].timestamp == 100.0
    log.publish(BlockRemoved([h[0]], "gpu"))
    log.publish(AllBlocksCleared("cpu"))
    assert log.since(0) is None           # record 1 dropped from the ring of 3
    assert [r.seq for r in log.since(1)] == [2, 3, 4]
    assert log.since(4) == []
    assert log.since(9) is None           # ahead of the log: the engine restarted
    snap = log.snapshot()
    assert snap.seq == 4 and snap.engine_id == "engine-7"
    assert snap.hashes == {"gpu": frozenset({h[1]}), "cpu": frozenset(), "remote": frozenset()}
    with pytest.raises(ValueError):
        log.since(-1)
    with pytest.raises(ValueError, match="tier"):
        log.publish(AllBlocksCleared("disk"))
    assert log.latest_seq == 4


def test_event_log_concurrent_reader_sees_contiguous_sequence():
    log = KVEventLog("e", capacity=100_000)
    n = 5000
    seen: list[int] = []
    done = threading.Event()

    def reader():
        last = 0
        while True:
            finished = done.is_set()
            recs = log.since(last)
            assert recs is not None
            for r in recs:
                seen.append(r.seq)
            if recs:
                last = recs[-1].seq
            if finished and last == n:
                return

    t = threading.Thread(target=reader)
    t.start()
    for i in range(n):
        log.publish(BlockStored([i.to_bytes(32, "little")], None, [i], 1, "gpu"))
    done.set()
    t.join(timeout=30)
    assert not t.is_alive()
    assert seen == list(range(1, n + 1))
    assert len(log.snapshot().hashes["gpu"]) == n


# ------------------------------------------------------------------ randomized

@dataclass
class SimReq:
    rid: str
    tokens: list[int]
    max_new: int
    computed: int = 0
    generated: int = 0
    admitted: bool = False
    hit_blocks: list[int] = field(default_factory=list)


class Subscriber:
    """Follows a KVEventLog the way the router would, resyncing on gaps."""

    def __init__(self, log: KVEventLog) -> None:
        self.log = log
        self.seq = 0
        self.view: set[bytes] = set()
        self.resyncs = 0

    def poll(self) -> None:
        recs = self.log.since(self.seq)
        if recs is None:
            snap = self.log.snapshot()
            self.view, self.seq = set(snap.hashes["gpu"]), snap.seq
            self.resyncs += 1
            return
        for r in recs:
            ev = r.event
            if isinstance(ev, BlockStored):
                self.view.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                self.view.difference_update(ev.block_hashes)
            else:
                self.view.clear()
            self.seq = r.seq


def run_simulation(seed: int, block_size: int, num_blocks: int, steps: int) -> dict[str, int]:
    rng = random.Random(seed)
    log = KVEventLog("sim", capacity=8)
    counts = dict(hits=0, preemptions=0, finished=0, evictions=0)

    def on_event(ev) -> None:
        counts["evictions"] += isinstance(ev, BlockRemoved)
        log.publish(ev)

    kv = KVCacheManager(num_blocks, block_size, True, EXTRA, on_event=on_event)
    capacity = num_blocks * block_size  # a request longer than the whole pool could never run
    sub = Subscriber(log)
    content: dict[int, list[int | None]] = {}  # what the 'model' wrote into each block's slots
    families = [[rng.randrange(50) for _ in range(rng.randint(block_size, 4 * block_size))] for _ in range(3)]
    waiting: list[SimReq] = []
    running: list[SimReq] = []
    next_id = 0

    def check() -> None:
        kv.check_integrity()
        assert log.snapshot().hashes["gpu"] == set(kv.pool.cached)
        if rng.random() < 0.3:
            sub.poll()
            assert sub.view == set(kv.pool.cached)

    def compute(req: SimReq, num_new: int) -> None:
        ids = kv.block_ids(req.rid)
        for pos in range(req.computed, req.computed + num_new):
            blk = kv.pool.blocks[ids[pos // block_size]]
            # Only a private, unhashed block may be written: anything else is shared content.
            assert blk.ref_cnt == 1 and blk.block_hash is None, (req.rid, pos, blk)
            content.setdefault(blk.block_id, [None] * block_size)[pos % block_size] = req.tokens[pos]
        req.computed += num_new
        kv.cache_blocks(req.rid, req.tokens, req.computed)
        if req.computed == len(req.tokens):
            if req.generated >= req.max_new:
                kv.free(req.rid)
                running.remove(req)
                counts["finished"] += 1
            else:
                req.tokens.append(rng.randrange(50))
                req.generated += 1

    def preempt() -> None:
        victim = running.pop()
        kv.free(victim.rid)
        victim.computed, victim.admitted = 0, False
        waiting.insert(0, victim)
        counts["preemptions"] += 1

    for _ in range(steps):
        if rng.random() < 0.35:
            prompt = list(rng.choice(families)) + [rng.randrange(50) for _ in range(rng.randint(0, 2 * block_size))]
            if rng.random() < 0.2:
                prompt = prompt[:rng.randint(1, len(prompt))]
            prompt = prompt[:capacity - 1]
            max_new = min(rng.randint(0, 3 * block_size), capacity - len(prompt))
            waiting.append(SimReq(f"r{next_id}", prompt, max_new))
            next_id += 1
        budget = rng.randint(1, 3 * block_size)
        # Running requests first (decode and unfinished prefill chunks), preempting under pressure.
        for req in list(running):
            if req not in running:
                continue
            num_new = min(len(req.tokens) - req.computed, budget)
            while kv.allocate_slots(req.rid, req.tokens, num_new, num_computed_tokens=req.computed) is None:
                preempt()
                check()
                if req not in running:
                    break
            if req in running:
                compute(req, num_new)
            check()
        # Admit waiting requests in order while they fit.
        while waiting:
            req = waiting[0]
            hits, n = kv.get_computed_blocks(req.rid, req.tokens)
            own = hash_blocks(req.tokens, block_size, EXTRA)
            assert [b.block_hash for b in hits] == own[:len(hits)]
            for i, b in enumerate(hits):
                assert content[b.block_id] == req.tokens[i * block_size:(i + 1) * block_size]
            num_new = min(len(req.tokens) - n, budget)
            if kv.allocate_slots(req.rid, req.tokens, num_new, hits, n) is None:
                check()
                break
            counts["hits"] += len(hits)
            waiting.pop(0)
            req.computed, req.admitted = n, True
            running.append(req)
            compute(req, num_new)
            check()
        if rng.random() < 0.05 and running:
            preempt()
            check()
    for req in running + waiting:
        kv.free(req.rid)
        check()
    assert kv.num_free_blocks == num_blocks
    assert kv.reset_prefix_cache()
    check()
    return counts


@pytest.mark.parametrize("seed,block_size,num_blocks", [(0, 1, 24), (1, 2, 20), (2, 4, 16), (3, 16, 6)])
def test_randomized_requests_under_memory_pressure(seed, block_size, num_blocks):
    counts = run_simulation(seed, block_size, num_blocks, steps=400)
    # The run must actually exercise the interesting paths.
    assert counts["hits"] > 0 and counts["preemptions"] > 0 and counts["finished"] > 0
    assert counts["evictions"] > 0
