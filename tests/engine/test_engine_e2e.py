"""The whole engine on a tiny random model (fast, no download): prefix hits, chunked prefill
and preemption in the same run, against transformers' unpaged forward in fp32."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvmesh.engine.block_hash import ROOT_HASH, hash_block
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.llm import LLM
from kvmesh.engine.sampling import SamplingParams

from tests.support.tiny_engine import hf_greedy
from tests.support.tiny_models import make_tiny_hf_model

MAX_NEW = 12
SHARED = [(11 * j) % 800 + 50 for j in range(22)]  # a common prefix: 5 full blocks of 4 and a bit
PROMPTS = [SHARED + [(13 * i + 7 * j) % 900 + 20 for j in range(3 + 4 * i)] for i in range(6)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf_model("llama", tmp_path_factory.mktemp("e2e"))


@pytest.fixture(scope="module")
def reference(model_dir) -> list[list[int]]:
    """transformers' greedy tokens, one prompt at a time, recomputing the whole sequence each step."""
    return hf_greedy(model_dir, PROMPTS, MAX_NEW)


def test_prefix_hits_chunked_prefill_and_preemption_together(model_dir, reference):
    from kvmesh.engine.model.loader import load_model

    loaded = load_model(str(model_dir), torch.float32)
    longest = max(len(p) for p in PROMPTS) + MAX_NEW
    cfg = EngineConfig(model=str(model_dir), dtype="float32", device="cpu", block_size=4,
                       max_num_batched_tokens=10,  # chunks prompts; not a multiple of the block size
                       num_kv_blocks=-(-longest // 4) + 4,  # one long request and a little more: preemption
                       admission_reserve_tokens=0,  # admit while blocks last, so growth preempts
                       enable_prefix_caching=True, enable_chunked_prefill=True)
    llm = LLM(engine=LLMEngine(cfg, loaded=dataclasses.replace(loaded, weights=dict(loaded.weights)),
                               debug_checks=True))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    first = llm.generate(PROMPTS, params)
    second = llm.generate(PROMPTS, params)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0, "the small pool forced no preemption"
    assert all(len(p) > cfg.max_num_batched_tokens for p in PROMPTS), "some prompt was not chunked"
    assert sum(r.num_cached_tokens for r in first + second) > 0, "no prefix hit"
    assert stats.prefix_hits == sum(r.num_cached_tokens for r in first + second)
    assert stats.prefix_queries == 2 * sum(len(p) for p in PROMPTS)
    for i, (a, b) in enumerate(zip(first, second)):
        assert a.token_ids == reference[i], f"prompt {i}, first pass"
        assert b.token_ids == reference[i], f"prompt {i}, second pass"


def _cached_block_ids(engine: LLMEngine, prompt: list[int]) -> list[int]:
    """The primary pool's blocks holding ``prompt``'s full blocks (the chain of the default root)."""
    bs, prev, ids = engine.kv.block_size, ROOT_HASH, []
    for i in range(len(prompt) // bs):
        prev = hash_block(prev, prompt[i * bs:(i + 1) * bs], engine.kv.extra)
        ids.append(engine.kv.pool.get_cached_block(prev).block_id)
    return ids


def test_a_whole_block_aligned_prompt_hit_runs_only_its_last_token_and_leaves_shared_blocks_alone(model_dir):
    """Real engine, tiny random model: a prompt whose every block is cached runs one token again
    for its logits; that token's KV write goes to the scratch block, so the cached block the other
    requests share keeps its bytes, and the tokens equal transformers'."""
    from kvmesh.engine.model.loader import load_model

    prompt = [(7 * j) % 900 + 40 for j in range(24)]  # 6 full blocks of 4
    loaded = load_model(str(model_dir), torch.float32)
    cfg = EngineConfig(model=str(model_dir), dtype="float32", device="cpu", block_size=4, num_kv_blocks=64)
    llm = LLM(engine=LLMEngine(cfg, loaded=dataclasses.replace(loaded, weights=dict(loaded.weights)),
                               debug_checks=True))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    first = llm.generate([prompt], params)[0]
    engine = llm.engine
    ids = _cached_block_ids(engine, prompt)
    before = engine.runner.kv_cache[:, :, ids].clone()
    again = llm.generate([prompt, prompt, prompt + [5]], params)  # two share the hit in one step
    assert [r.num_cached_tokens for r in again] == [23, 23, 24]
    assert engine.stats().prefix_hits == sum(r.num_cached_tokens for r in [first, *again])
    assert torch.equal(engine.runner.kv_cache[:, :, ids], before), "a shared cached block changed"
    want = hf_greedy(model_dir, [prompt, prompt + [5]], MAX_NEW)
    assert [first.token_ids, *(r.token_ids for r in again)] == [want[0], want[0], want[0], want[1]]
