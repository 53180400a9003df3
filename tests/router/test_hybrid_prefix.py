"""The prefix scorer for hybrid engines: a hit counts only up to the last checkpointed block.

Real: the router's PrefixIndex and Fleet.prefix_matches, fed internal KV events (KV blocks in
``gpu``, checkpoints in ``state-gpu``) as its subscriber delivers them; for the agreement test,
the engine's own admission rule (HybridStateManager.hit over a real CheckpointIndex). No I/O.
"""

from __future__ import annotations

import random

from kvmesh.engine.block_hash import extra_key, hash_blocks, max_hit_blocks
from kvmesh.engine.kv.events import BlockStored, branch_points, checkpoint_removed, checkpoint_stored
from kvmesh.engine.kv.hybrid_state import HybridStateManager
from kvmesh.engine.kv.state_checkpoints import CheckpointIndex
from kvmesh.engine.router.discovery import EngineState, Fleet
from kvmesh.engine.router.index import NO_MATCH, PrefixIndex
from kvmesh.engine.router.prompt import PromptInfo, matched_tokens

EXTRA = extra_key("m", "float32")
BS = 4


def chain(tokens):
    return hash_blocks(tokens, BS, EXTRA)


def kv(hashes):
    return BlockStored(list(hashes), None, [], BS)


def test_a_hybrid_hit_ends_at_the_last_checkpointed_block():
    h = chain(list(range(24)))  # 6 blocks
    idx = PrefixIndex()
    idx.apply("e", kv(h[:5]))
    idx.apply("e", checkpoint_stored([h[1], h[3], h[5]], BS))  # block 5's KV is not cached
    assert idx.match("e", h).blocks == 5  # attention-only reading: every cached block counts
    got = idx.match("e", h, restore_points=True)
    assert (got.blocks, got.per_tier, got.weighted) == (4, {"gpu": 4}, 4.0)
    idx.apply("e", checkpoint_removed([h[3]]))
    assert idx.match("e", h, restore_points=True).blocks == 2
    idx.apply("e", checkpoint_removed([h[1]]))
    assert idx.match("e", h, restore_points=True) is NO_MATCH  # KV without a restore point: no hit


def test_checkpoints_never_count_as_kv_blocks():
    h = chain(list(range(16)))
    idx = PrefixIndex()
    idx.apply("e", checkpoint_stored(h, BS))
    assert idx.match("e", h) is NO_MATCH and idx.match("e", h, restore_points=True) is NO_MATCH
    assert idx.size() == {"e": {"gpu": 0, "cpu": 0, "remote": 0, "state-gpu": 4}}
    assert idx.hashes("e")["gpu"] == frozenset()


def _fleet(hybrid: bool) -> Fleet:
    fleet = Fleet(session=None, urls=["http://e"])  # type: ignore[arg-type]  # no I/O in prefix_matches
    fleet.engines["http://e"] = EngineState("http://e", healthy=True, info={
        "engine_id": "x", "block_size": BS, "extra_key": EXTRA.hex(), "hybrid": hybrid, "kv_events": {"port": 1}})
    return fleet


def test_fleet_cuts_back_from_where_the_engine_stops_looking():
    """A prompt of exactly 3 blocks: a hybrid engine looks up at most 2 (it computes the last
    token from a recurrent state), then cuts back to a checkpoint. With checkpoints at blocks 1 and
    3 it serves 1 block; cutting back from 3 first would predict 2. A dense engine hits all 3 and
    runs the last token again: 11 tokens cached."""
    tokens = list(range(100, 112))
    h = chain(tokens)
    for hybrid, want in ((False, 11 / BS), (True, 1)):
        fleet = _fleet(hybrid)
        fleet.index.apply("http://e", kv(h))
        fleet.index.apply("http://e", checkpoint_stored([h[0], h[2]], BS))
        matches, bs = fleet.prefix_matches(PromptInfo(tokens, num_prompt_tokens=len(tokens)))
        assert matched_tokens(matches["http://e"].blocks, bs, len(tokens)) == want * BS, hybrid


def test_the_router_tells_a_hybrid_engine_where_the_pools_cached_prefixes_of_the_prompt_end():
    """Engine e holds a 6-block prompt's KV with a checkpoint at its end only; a new prompt shares
    3 blocks: e's KV run (3) ends past its last checkpoint there (0), so the engine computing
    the prompt is told to checkpoint at 3 blocks. A branch point e reported is a hint too. An
    attention-only pool gets none."""
    old = list(range(100, 124))
    new = old[:12] + list(range(500, 514))
    h_old, h_new = chain(old), chain(new)
    fleet = _fleet(True)
    fleet.index.apply("http://e", kv(h_old))
    fleet.index.apply("http://e", checkpoint_stored([h_old[5]], BS))
    info = PromptInfo(new, num_prompt_tokens=len(new))
    assert fleet.state_hints(info) == (3 * BS,)
    fleet.index.apply("http://e", branch_points([h_new[1]], BS))
    assert fleet.state_hints(info) == (2 * BS, 3 * BS)
    fleet.index.apply("http://e", checkpoint_stored([h_new[2]], BS))  # a checkpoint where the KV ends
    assert fleet.state_hints(info) == (2 * BS,)
    plain = _fleet(False)
    plain.index.apply("http://e", kv(h_old))
    assert plain.state_hints(info) == ()


def test_the_router_predicts_what_the_engines_admission_rule_serves():
    """Random caches: for every prompt the router's hybrid match equals what the engine's own
    admission computes (contiguous KV blocks up to its lookup limit, then HybridStateManager.hit
    over the real CheckpointIndex the same hashes were published to)."""
    rng = random.Random(7)
    for trial in range(300):
        n_blocks = rng.randint(1, 12)
        tokens = [rng.randrange(50) for _ in range(n_blocks * BS + rng.randrange(BS))]
        h = chain(tokens)
        cached = [rng.random() < 0.85 for _ in h]
        ckpt = [rng.random() < 0.3 for _ in h]
        index = PrefixIndex()
        index.apply("e", kv([x for x, c in zip(h, cached) if c]))
        index.apply("e", checkpoint_stored([x for x, c in zip(h, ckpt) if c], BS))
        states = HybridStateManager(2, BS, CheckpointIndex(len(h) + 1))
        for x, c in zip(h, ckpt):
            if c:
                e = states.checkpoints.reserve()
                states.checkpoints.publish(e, x)
        limit = max_hit_blocks(len(tokens), BS, whole=False)
        run = next((i for i, c in enumerate(cached[:limit]) if not c), limit)
        engine_blocks, _ = states.hit(h, run)
        router = index.match("e", h[:limit], restore_points=True)
        assert router.blocks == engine_blocks, (trial, cached, ckpt, len(tokens))

