"""The prefix index, driven directly with internal KV events and snapshots."""

import pytest

from kvmesh.engine.block_hash import extra_key, hash_blocks
from kvmesh.engine.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventLog, KVSnapshot
from kvmesh.engine.router.index import NO_MATCH, TIER_WEIGHTS, PrefixIndex

EXTRA = extra_key("m", "bfloat16")
BS = 4


def chain(tokens):
    return hash_blocks(tokens, BS, EXTRA)


def stored(hashes, tier="gpu"):
    return BlockStored(list(hashes), None, [0] * (BS * len(hashes)), BS, tier)


def test_longest_prefix_counts_the_contiguous_run_from_block_zero():
    h = chain(list(range(20)))  # 5 blocks
    idx = PrefixIndex()
    idx.apply("a", stored(h[:3]))
    idx.apply("b", stored(h[:1]))
    idx.apply("b", stored(h[2:5]))  # a hole at block 1: only block 0 is usable
    got = idx.longest_prefix(h)
    assert got["a"].blocks == 3 and got["a"].per_tier == {"gpu": 3} and got["a"].weighted == 3.0
    assert got["b"].blocks == 1
    assert idx.match("nobody", h) is NO_MATCH
    assert idx.match("a", []) is NO_MATCH


def test_tiers_are_weighted_gpu_over_cpu_over_remote_and_a_block_counts_in_its_best_tier():
    h = chain(list(range(16)))
    idx = PrefixIndex()
    idx.apply("e", stored(h[:1], "remote"))
    idx.apply("e", stored(h[:2], "cpu"))
    idx.apply("e", stored(h[:1], "gpu"))
    idx.apply("e", stored(h[2:4], "remote"))
    m = idx.match("e", h)
    assert m.blocks == 4
    assert m.per_tier == {"gpu": 1, "cpu": 1, "remote": 2}
    assert m.weighted == pytest.approx(TIER_WEIGHTS["gpu"] + TIER_WEIGHTS["cpu"] + 2 * TIER_WEIGHTS["remote"])
    assert TIER_WEIGHTS["gpu"] > TIER_WEIGHTS["cpu"] > TIER_WEIGHTS["remote"] > 0


def test_removed_and_cleared_events_shrink_the_index():
    h = chain(list(range(16)))
    idx = PrefixIndex()
    idx.apply("e", stored(h))
    idx.apply("e", stored(h[:2], "cpu"))
    idx.apply("e", BlockRemoved(h[1:2]))
    assert idx.match("e", h).per_tier == {"gpu": 3, "cpu": 1}  # block 1 still in cpu
    idx.apply("e", AllBlocksCleared("gpu"))
    assert idx.size()["e"] == {"gpu": 0, "cpu": 2, "remote": 0}
    idx.apply("e", AllBlocksCleared("cpu"))
    assert idx.total_size() == 0


def test_snapshot_replaces_and_remove_engine_frees():
    h = chain(list(range(12)))
    idx = PrefixIndex()
    idx.apply("e", stored(h))
    idx.reset("e", KVSnapshot(7, "e", {"gpu": frozenset(h[:1]), "cpu": frozenset(h[1:2])}))
    assert idx.hashes("e")["gpu"] == frozenset(h[:1])
    assert idx.size()["e"] == {"gpu": 1, "cpu": 1, "remote": 0}
    idx.remove_engine("e")
    assert "e" not in idx and idx.total_size() == 0
    idx.remove_engine("e")  # idempotent


def test_index_mirrors_an_event_log_under_random_churn():
    """Replaying a log with evictions leaves index size == the engine's cached blocks."""
    import random

    rng = random.Random(3)
    log = KVEventLog("e")
    idx = PrefixIndex()
    log_records = []
    live = {"gpu": [], "cpu": []}
    for step in range(2000):
        tier = rng.choice(["gpu", "cpu"])
        if live[tier] and rng.random() < 0.45:
            victims = rng.sample(live[tier], k=min(len(live[tier]), rng.randint(1, 4)))
            for v in victims:
                live[tier].remove(v)
            log_records.append(log.publish(BlockRemoved(victims, tier)))
        elif rng.random() < 0.01:
            live[tier].clear()
            log_records.append(log.publish(AllBlocksCleared(tier)))
        else:
            hs = chain([rng.randrange(1000) for _ in range(BS * rng.randint(1, 3))])
            new = [x for x in hs if x not in live[tier]]
            live[tier].extend(new)
            log_records.append(log.publish(stored(hs, tier)))
    for rec in log_records:
        idx.apply("e", rec.event)
    snap = log.snapshot()
    assert idx.hashes("e") == {**{t: frozenset() for t in ("gpu", "cpu", "remote")}, **snap.hashes}
    assert idx.total_size() == sum(len(s) for s in snap.hashes.values())


def test_rejects_unknown_tiers_and_bad_weights():
    idx = PrefixIndex()
    with pytest.raises(ValueError, match="unknown KV tier"):
        idx.apply("e", BlockStored([b"x" * 32], None, [0] * BS, BS, "disk"))
    with pytest.raises(ValueError, match="missing remote"):
        PrefixIndex({"gpu": 1.0, "cpu": 0.5})
