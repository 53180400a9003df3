"""A hybrid engine's checkpoints in its KV event stream, and the router's prediction from it.

Real: the engine (tiny random Qwen3.5 text model, fp32, transformers-written weights), its
KVEventLog, its CheckpointIndex, the router's PrefixIndex fed with the log's records, and the
``/kv/info`` body the server sends. Token parity of these runs with transformers is held by
test_hybrid_checkpoints.py; here the outputs' ``num_cached_tokens`` are what is checked.
"""

from __future__ import annotations


from kvmesh.engine.block_hash import hash_blocks, max_hit_blocks
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.kv.events import BlockRemoved, BlockStored
from kvmesh.engine.llm import LLM
from kvmesh.engine.model.recurrent_state import StatePool
from kvmesh.engine.model.safetensors_loader import read_hf_config
from kvmesh.engine.router.index import PrefixIndex
from kvmesh.engine.router.prompt import matched_tokens
from kvmesh.engine.sampling import SamplingParams
from kvmesh.engine.server.kv_routes import kv_info

BS = 16  # the engine's default block size


def _engine(hybrid_dir, **cfg) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(hybrid_dir), dtype="float32", num_kv_blocks=256, **cfg),
                     debug_checks=True)


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _checkpoints_match_the_stream(engine: LLMEngine) -> set:
    ck = engine.state_slots.checkpoints
    streamed = engine.events.snapshot().hashes.get("state-gpu", frozenset())
    assert all(h in ck for h in streamed) and len(streamed) == ck.snapshot().published
    return set(streamed)


def test_checkpoints_are_published_and_evicted_in_the_stream_and_predict_every_hit(hybrid_dir):
    """Two interleaved conversations on a 3-entry checkpoint pool, once pushed out by a long
    unrelated prompt (their KV stays, their checkpoints go): after every request the
    stream's ``state-gpu`` set equals the pool's published hashes (stored and removed records
    seen), and a router index replaying the stream predicts each request's ``num_cached_tokens``
    exactly, where counting the cached KV blocks alone would over-predict."""
    per = StatePool.bytes_per_slot(read_hf_config(hybrid_dir), 4)
    engine = _engine(hybrid_dir, state_checkpoint_bytes=3 * per, state_checkpoint_interval=32)
    llm = LLM(engine=engine)
    index, seen = PrefixIndex(), 0
    convs = {"a": [(11 * j) % 900 + 20 for j in range(70)], "b": [(7 * j) % 900 + 40 for j in range(45)],
             "filler": [(13 * j) % 900 + 30 for j in range(130)]}  # 4 captures: evicts every checkpoint
    hits = overpredicted = 0
    for turn in range(4):
        for name in ("a", "b", "filler") if turn == 1 else ("a", "b"):
            prompt = convs[name]
            for rec in engine.events.since(seen):
                index.apply("e", rec.event)
                seen = rec.seq
            hashes = hash_blocks(prompt, BS, engine.kv.extra)[:max_hit_blocks(len(prompt), BS, whole=False)]
            predicted = matched_tokens(index.match("e", hashes, restore_points=True).blocks, BS, len(prompt))
            kv_only = matched_tokens(index.match("e", hashes).blocks, BS, len(prompt))
            out = llm.generate([prompt], _params(9 + turn))[0]
            assert predicted == out.num_cached_tokens, (turn, name, predicted, out.num_cached_tokens)
            hits += out.num_cached_tokens > 0
            overpredicted += kv_only > out.num_cached_tokens
            convs[name] = prompt + out.token_ids + [5 + turn, 6, 7]  # the next turn extends this one
            _checkpoints_match_the_stream(engine)
    records = [r.event for r in engine.events.since(0)]
    assert any(isinstance(e, BlockStored) and e.tier == "state-gpu" for e in records)
    assert any(isinstance(e, BlockRemoved) and e.tier == "state-gpu" for e in records)
    assert engine.stats().state_checkpoints.evictions > 0
    assert hits >= 2 and overpredicted >= 2  # the cut back mattered, and hits happened


def test_kv_info_says_hybrid_and_names_the_checkpoint_medium(hybrid_dir):
    engine = _engine(hybrid_dir, state_checkpoint_interval=32)
    info = kv_info(engine, None)
    assert info["hybrid"] is True
    assert info["state_checkpoints"]["medium"] == "state-gpu"
    assert info["state_checkpoints"]["interval_tokens"] == 32 and info["state_checkpoints"]["capacity"] > 0
    off = kv_info(_engine(hybrid_dir, state_checkpoint_bytes=0), None)
    assert off["hybrid"] is True and off["state_checkpoints"] is None  # no pool: no hybrid hits at all
