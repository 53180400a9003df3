"""Host KV tier: the tier on its own (slots, LRU, events, reserve/promote), and the engine reloading
evicted prefixes from it on a tiny random model against transformers' unpaged forward."""

from __future__ import annotations


import pytest
import torch

from kvmesh.engine.config import ConfigError, EngineConfig
from kvmesh.engine.kv.block_pool import KVBlock
from kvmesh.engine.kv.events import TIER_CPU, TIER_GPU, BlockRemoved, BlockStored
from kvmesh.engine.kv.host_tier import HostTier

from tests.support.tiny_engine import BS, OTHER, PROMPTS, greedy, hf_greedy, tiny_engine

SHAPE = (2, 2, 4, 2, 8)  # layers, K/V, block_size, heads, head_dim


def _evicted(block_id: int, h: bytes, parent: bytes | None = None) -> KVBlock:
    return KVBlock(block_id, block_hash=h, parent_hash=parent)


def _cache(num_blocks: int = 8) -> torch.Tensor:
    kv = torch.randn(SHAPE[0], 2, num_blocks, *SHAPE[2:])
    return kv


def test_saves_promotes_and_loads_exact_bytes():
    events = []
    tier = HostTier(4, SHAPE, torch.float32, torch.device("cpu"), 4, events.append)
    kv = _cache()
    h = [bytes([i]) * 32 for i in range(3)]
    tier.save([_evicted(5, h[0]), _evicted(2, h[1], h[0]), _evicted(7, h[2], h[1])])
    tier.flush_saves(kv)
    kv[:, :, [5, 2, 7]] = 0.0  # the primary blocks get new content
    assert tier.count(h) == 3 and tier.count(h[1:]) == 2
    tier.reserve(h[:2])
    assert tier.count(h) == 0  # reserved blocks are not offered twice
    tier.promote(h[:2], [1, 3])
    src, ids = tier.take_loads()
    assert ids == [1, 3] and src.shape == (2, *SHAPE)
    tier.check_integrity()
    assert events[0] == BlockStored(h, None, [], 4, TIER_CPU)  # one chained run, one event
    assert events[1] == BlockRemoved(h[:2], TIER_CPU)
    assert h[2] in tier and h[0] not in tier and tier.used_blocks == 1


def test_loads_land_in_the_primary_blocks():
    tier = HostTier(4, SHAPE, torch.float32, torch.device("cpu"), 4)
    kv = _cache()
    want = kv[:, :, [5, 6]].clone()
    h = [b"a" * 32, b"b" * 32]
    tier.save([_evicted(5, h[0]), _evicted(6, h[1], h[0])])
    tier.flush_saves(kv)
    kv.zero_()
    tier.reserve(h)
    tier.promote(h, [0, 3])
    src, ids = tier.take_loads()
    kv.index_copy_(2, torch.tensor(ids), src.movedim(0, 2))
    assert torch.equal(kv[:, :, [0, 3]], want)


def test_lru_within_budget_and_reserved_blocks_survive():
    events = []
    tier = HostTier(2, SHAPE, torch.float32, torch.device("cpu"), 4, events.append)
    kv = _cache()
    a, b, c, d = (bytes([x]) * 32 for x in b"abcd")
    tier.save([_evicted(0, a), _evicted(1, b)])
    tier.reserve([a])
    tier.save([_evicted(2, c)])  # evicts b (a is reserved)
    assert BlockRemoved([b], TIER_CPU) in events and a in tier and c in tier
    tier.save([_evicted(3, d)])  # only c is evictable
    assert d in tier and c not in tier and tier.used_blocks == 2
    tier.release([a])
    tier.flush_saves(kv)
    tier.take_loads()
    tier.check_integrity()


def test_promoted_slots_are_not_reused_before_the_flush():
    """A slot freed by a promotion may still be read by that promotion's load: a save in the same
    step must not overwrite it."""
    tier = HostTier(1, SHAPE, torch.float32, torch.device("cpu"), 4)
    kv = _cache()
    a, b = b"a" * 32, b"b" * 32
    tier.save([_evicted(0, a)])
    tier.flush_saves(kv)
    want = kv[:, :, 0].clone()
    tier.reserve([a])
    tier.promote([a], [4])
    tier.save([_evicted(1, b)])  # no free slot this step: dropped, counted
    assert tier.stats.dropped == 1 and b not in tier
    tier.flush_saves(kv)
    src, ids = tier.take_loads()
    assert torch.equal(src[0], want) and ids == [4]
    tier.save([_evicted(1, b)])  # the slot is free again after the flush
    assert b in tier


# ---- the engine ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference(model_dir):
    return hf_greedy(model_dir, PROMPTS + OTHER)


def test_evicted_prefix_comes_back_from_the_host_tier_and_is_promoted(model_dir, loaded, reference):
    llm = tiny_engine(model_dir, loaded, num_kv_blocks=20, cpu_kv_bytes=1 << 20)
    eng = llm.engine
    first = llm.generate([PROMPTS[0]], greedy())[0]
    assert first.token_ids == reference[0]
    others = llm.generate(OTHER, greedy())
    assert [r.token_ids for r in others] == reference[len(PROMPTS):]
    cpu = eng.events.snapshot().hashes[TIER_CPU]
    assert cpu, "nothing was evicted into the host tier"
    host = eng.tiers.host
    assert host.stats.stored > 0 and eng.stats().kv_evictions >= host.stats.stored

    second = llm.generate([PROMPTS[1]], greedy())[0]  # shares the 10-block prefix, now on the host
    assert second.token_ids == reference[1]
    assert host.stats.hits > 0 and host.stats.promotions > 0
    assert second.num_cached_tokens >= host.stats.hits
    snap = eng.events.snapshot().hashes
    assert not (snap[TIER_GPU] & snap[TIER_CPU]), "a block is advertised in two tiers"

    hits_before = eng.stats().prefix_hits
    third = llm.generate([PROMPTS[2]], greedy())[0]  # promoted blocks now hit in the primary pool
    assert third.token_ids == reference[2]
    assert eng.stats().prefix_hits - hits_before >= host.stats.hits
    eng.check_integrity()


def test_zero_hits_with_the_tier_on_change_nothing(model_dir, loaded, reference):
    llm = tiny_engine(model_dir, loaded, num_kv_blocks=16, cpu_kv_bytes=1 << 20, max_num_batched_tokens=12)
    res = llm.generate(OTHER + PROMPTS, greedy())
    assert [r.token_ids for r in res] == reference[len(PROMPTS):] + reference[:len(PROMPTS)]
    llm.engine.check_integrity()


def test_tiny_host_tier_drops_and_counts(model_dir, loaded, reference):
    block_bytes = 2 * 2 * BS * 2 * 16 * 4  # layers, K/V, block, kv heads, head_dim, fp32
    llm = tiny_engine(model_dir, loaded, num_kv_blocks=16, cpu_kv_bytes=2 * block_bytes)
    res = llm.generate(OTHER + PROMPTS, greedy())
    assert [r.token_ids for r in res] == reference[len(PROMPTS):] + reference[:len(PROMPTS)]
    host = llm.engine.tiers.host
    assert host.num_slots == 2 and host.used_blocks <= 2 and host.stats.evictions > 0
    llm.engine.check_integrity()


def test_tiers_need_prefix_caching():
    with pytest.raises(ConfigError, match="prefix caching"):
        EngineConfig(cpu_kv_bytes=1 << 20, enable_prefix_caching=False).validate()
