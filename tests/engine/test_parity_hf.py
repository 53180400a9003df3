"""Greedy parity with Hugging Face transformers on the real default model in fp32.

Every engine mode must reproduce transformers' greedy tokens. Where a token
differs, transformers' own top-2 logits at that position must be a near tie
(< 1e-3 apart); such cases are counted and reported, anything else fails.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.llm import LLM
from kvmesh.engine.sampling import SamplingParams

pytestmark = pytest.mark.slow  # the default model against transformers in every mode: about 5 min

NEAR_TIE = 1e-3
MAX_NEW = 24
QUESTIONS = [
    "What is the capital of France?",
    "Hi",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue, and mention Rayleigh scattering by name.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish, French and German, one per line, and say which "
    "of the three languages has the most native speakers in Europe.",
    "What is 12 times 12?",
    "Describe a cat to someone who has never seen one. Be brief but vivid, and avoid clichés; "
    "mention its whiskers, its tail, the way it walks and the sound it makes when it is content.",
    "Name a famous painter.",
    "Why do we have seasons?",
]


@pytest.fixture(scope="module")
def loaded():
    from kvmesh.engine.model.loader import load_model

    return load_model("default", torch.float32)


@pytest.fixture(scope="module")
def prompts(loaded):
    return [loaded.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    from kvmesh.engine.model.fetch import ensure_default_model

    path = ensure_default_model(progress=False)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None  # run the full length, as ignore_eos does
    return model


def _hf_generate(model, prompts, **controls) -> list:
    """transformers' greedy tokens and per-step scores (the logits after its processors, which are
    the raw logits without `controls`), one prompt at a time (no padding)."""
    refs = []
    with torch.inference_mode():
        for ids in prompts:
            # An explicit mask: the prompt contains <|im_end|>, which is also the pad id, and
            # transformers would otherwise infer a mask that hides those tokens.
            x = torch.tensor([ids])
            out = model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW, do_sample=False, output_scores=True,
                return_dict_in_generate=True, pad_token_id=2, **controls,
            )
            toks = out.sequences[0, len(ids):].tolist()
            refs.append((toks, torch.stack([s[0] for s in out.scores])))  # [steps, vocab]
    return refs


@pytest.fixture(scope="module")
def hf_reference(hf_model, prompts):
    return _hf_generate(hf_model, prompts)


def _engine(loaded, **cfg) -> LLM:
    copy = dataclasses.replace(loaded, weights=dict(loaded.weights))
    config = EngineConfig(model="default", dtype="float32", **cfg)
    return LLM(engine=LLMEngine(config, loaded=copy, debug_checks=True))


def _compare(results, refs) -> int:
    """Assert parity up to near ties; returns the number of near-tie divergences."""
    near_ties = 0
    for i, (res, (ref_toks, ref_logits)) in enumerate(zip(results, refs)):
        got = res.token_ids
        assert len(got) == MAX_NEW, f"prompt {i}: {len(got)} tokens, finish {res.finish_reason}"
        for j, (a, b) in enumerate(zip(got, ref_toks)):
            if a == b:
                continue
            top2 = ref_logits[j].topk(2).values
            margin = float(top2[0] - top2[1])
            assert margin < NEAR_TIE, (
                f"prompt {i} token {j}: kvmesh {a} != transformers {b}, top-2 margin {margin:.2e} "
                f"is not a near tie\nkvmesh: {got}\nhf:     {ref_toks}"
            )
            near_ties += 1
            break  # past a divergence the contexts differ
    return near_ties


def _params():
    return SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def test_cold_then_prefix_cache(loaded, prompts, hf_reference):
    llm = _engine(loaded)
    cold = llm.generate(prompts, _params())
    ties = _compare(cold, hf_reference)
    assert all(r.num_cached_tokens == 0 for r in cold[:1])
    warm = llm.generate(prompts, _params())
    ties += _compare(warm, hf_reference)
    cached = sum(r.num_cached_tokens for r in warm)
    assert cached > 0, "second pass was not served from the prefix cache"
    stats = llm.engine.stats()
    assert stats.prefix_hits >= cached
    print(f"cold+warm: near ties {ties}, cached tokens on second pass {cached}")


def test_chunked_prefill(loaded, prompts, hf_reference):
    shortest = min(len(p) for p in prompts)
    llm = _engine(loaded, max_num_batched_tokens=16)
    assert 16 < shortest
    ties = _compare(llm.generate(prompts, _params()), hf_reference)
    print(f"chunked prefill (budget 16): near ties {ties}")


def test_prefill_paced_beside_decodes(loaded, prompts, hf_reference):
    """Pacing with its rates pinned (1 s per prompt token, decode steps free) and a 500 ms target:
    every stream keeps its slack (steps here take well under 500 ms a token) and every slack is
    worth fewer than 16 tokens, so each prompt chunk beside a decode is cut to the pacer's floor of
    16 (or is the prompt's shorter end), where the 64-token budget alone would allow up to 63."""
    llm = _engine(loaded, max_num_batched_tokens=64, tpot_slo_ms=500.0)
    pacer = llm.engine.pacer
    pacer.prefill_s_per_token, pacer.decode_step_s = 1.0, 0.0
    pacer.observe = lambda *args: None
    chunks: list[int] = []
    schedule = llm.engine.scheduler.schedule

    def watched(now=None):
        out = schedule(now)
        if out.num_decodes:
            chunks.extend(s.num_new_tokens for s in out.seqs if s.num_new_tokens > 1)
        return out

    llm.engine.scheduler.schedule = watched
    ties = _compare(llm.generate(prompts, _params()), hf_reference)
    assert chunks and max(chunks) == 16, chunks
    print(f"paced prefill: near ties {ties}, prompt chunks beside decodes {chunks}")


def test_preemption_tiny_pool(loaded, prompts, hf_reference):
    longest = max(len(p) for p in prompts) + MAX_NEW
    blocks = -(-longest // 16) + 2  # room for one long request and a little more
    llm = _engine(loaded, num_kv_blocks=blocks, enable_prefix_caching=False, admission_reserve_tokens=0)
    results = llm.generate(prompts, _params())
    assert llm.engine.stats().num_preemptions > 0, "the tiny pool forced no preemption"
    ties = _compare(results, hf_reference)
    print(f"preemption: {llm.engine.stats().num_preemptions} preemptions, near ties {ties}")


def test_tiny_pool_with_the_admission_reserve(loaded, prompts, hf_reference):
    """The same tiny pool with the default admission reserve: requests queue for blocks instead of
    preempting one another (every request here generates fewer tokens than the reserve)."""
    longest = max(len(p) for p in prompts) + MAX_NEW
    llm = _engine(loaded, num_kv_blocks=-(-longest // 16) + 2, enable_prefix_caching=False)
    assert llm.engine.config.admission_reserve_tokens >= MAX_NEW
    results = llm.generate(prompts, _params())
    assert llm.engine.stats().num_preemptions == 0
    ties = _compare(results, hf_reference)
    print(f"admission reserve: near ties {ties}")


def test_ttft_first_admission(loaded, prompts, hf_reference):
    """One sequence at a time with a 1 ms TTFT target: every queued request turns late and is
    admitted from the late queue (the order rules themselves: tests/engine/test_ttft_admission.py)."""
    llm = _engine(loaded, max_num_seqs=1, ttft_slo_ms=1.0)
    results = llm.generate(prompts, _params())
    ties = _compare(results, hf_reference)
    print(f"TTFT-first admission: near ties {ties}")


def test_tpot_gated_admission(loaded, prompts, hf_reference):
    """A 1 microsecond TPOT gate: after the first step every stream is too slow for it, so requests
    join one at a time as others finish (the gate's rules: tests/engine/test_tpot_gate.py)."""
    llm = _engine(loaded, admission_tpot_ms=0.001)
    results = llm.generate(prompts, _params())
    ties = _compare(results, hf_reference)
    assert llm.engine.gate.step_s is not None
    print(f"TPOT-gated admission: near ties {ties}")


@pytest.mark.parametrize("block_size", [1, 16])
def test_block_sizes_with_prefix_hits(loaded, prompts, hf_reference, block_size):
    llm = _engine(loaded, block_size=block_size, max_num_batched_tokens=64)
    ties = _compare(llm.generate(prompts, _params()), hf_reference)
    again = llm.generate(prompts, _params())
    ties += _compare(again, hf_reference)
    assert sum(r.num_cached_tokens for r in again) > 0
    print(f"block size {block_size}: near ties {ties}")


def test_preemption_with_prefix_caching(loaded, prompts, hf_reference):
    """Preempted requests come back partly from the prefix cache: recompute must still match."""
    longest = max(len(p) for p in prompts) + MAX_NEW
    llm = _engine(loaded, num_kv_blocks=-(-longest // 16) + 2, enable_prefix_caching=True,
                  admission_reserve_tokens=0)
    ties = _compare(llm.generate(prompts, _params()), hf_reference)
    ties += _compare(llm.generate(prompts, _params()), hf_reference)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0, "the tiny pool forced no preemption"
    print(f"preemption with prefix caching: {stats.num_preemptions} preemptions, near ties {ties}")


def test_chunked_prefill_budget_not_multiple_of_block_size(loaded, prompts, hf_reference):
    """Chunks that end mid-block: a block is filled across steps and cached once full."""
    llm = _engine(loaded, max_num_batched_tokens=23, block_size=16)
    ties = _compare(llm.generate(prompts, _params()), hf_reference)
    again = llm.generate(prompts, _params())
    ties += _compare(again, hf_reference)
    assert sum(r.num_cached_tokens for r in again) > 0
    print(f"chunked prefill (budget 23, block 16): near ties {ties}")


def test_prefix_reloaded_from_the_host_tier(loaded, prompts, hf_reference):
    """A pool that holds about one request: every prompt's blocks are evicted into the host tier by
    the next ones, and the second pass loads them back (promotion) instead of recomputing."""
    longest = max(len(p) for p in prompts) + MAX_NEW
    llm = _engine(loaded, num_kv_blocks=-(-longest // 16) + 2, cpu_kv_bytes=256 << 20, max_num_seqs=1)
    ties = _compare(llm.generate(prompts, _params()), hf_reference)
    ties += _compare(llm.generate(prompts, _params()), hf_reference)
    host = llm.engine.tiers.host.stats
    assert host.hits > 0 and host.promotions > 0, host
    llm.engine.check_integrity()
    print(f"host tier: {host.hits} tokens reloaded, {host.promotions} promotions, near ties {ties}")


def test_prefix_reloaded_from_a_cache_node(loaded, prompts, hf_reference):
    """One engine computes the prompts and writes their blocks through to a cache node; a second engine
    reloads them from it instead of recomputing."""
    import time

    from tests.support.processes import NodeProc

    node = NodeProc(memory="512MiB", events=False).start()
    try:
        address = f"127.0.0.1:{node.http_port}"
        writer = _engine(loaded, cache_node=address, cache_node_timeout=30.0)
        reader = _engine(loaded, cache_node=address, cache_node_timeout=30.0)
        deadline = time.monotonic() + 60
        while (writer.engine._cache_node.clients() is None or reader.engine._cache_node.clients() is None) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        ties = _compare(writer.generate(prompts, _params()), hf_reference)
        remote = writer.engine.tiers.remote
        full = sum((len(p) + MAX_NEW - 1) // 16 for p in prompts)
        while (remote.inflight_bytes or remote.snapshot_stats().stored < full // 2) and time.monotonic() < deadline:
            time.sleep(0.1)
        ties += _compare(reader.generate(prompts, _params()), hf_reference)
        stats = reader.engine.tiers.remote.snapshot_stats()
        assert stats.hits > 0 and stats.failures == 0, stats
        reader.engine.check_integrity()
        print(f"cache node: {stats.hits} tokens reloaded, near ties {ties}")
        writer.engine.close()
        reader.engine.close()
    finally:
        node.stop()


def test_disaggregated_prefill_to_decode(loaded, prompts, hf_reference):
    """Prefill engine -> decode engine handoff (blocks, first token) on the default model: the decode
    side's tokens equal transformers', cold, and again with every prompt a prefix hit on prefill
    (a fresh decode engine, so the whole prompt's KV travels)."""
    from tests.support.handoff import handoff_once

    class _Result:
        def __init__(self, token_ids):
            self.token_ids, self.finish_reason = token_ids, "length"

    prefill = _engine(loaded, max_num_batched_tokens=32).engine  # chunked prefill on the prefill side
    ties = 0
    for rnd in range(2):
        decode = _engine(loaded).engine
        results = []
        for i, ids in enumerate(prompts):
            res, handoff, toks = handoff_once(prefill, decode, i + 100 * rnd, ids, _params())
            results.append(_Result(toks))
            if rnd == 1 or i == 0:  # the chat prompts share their system prompt: later cold ones hit it too
                assert (handoff.first.cached_tokens > 0) == (rnd == 1)
        ties += _compare(results, hf_reference)
        for e in (prefill, decode):
            e.check_integrity()
            assert not e.kv.requests
    print(f"disaggregated: near ties {ties}")


def test_repetition_penalty_matches_transformers(loaded, prompts, hf_model):
    """vLLM's repetition_penalty is transformers' (prompt and output tokens, divide positive
    logits, multiply negative ones): greedy tokens agree in a batch with chunked prefill and a
    small pool, where the penalty's count table outlives preemptions."""
    refs = _hf_generate(hf_model, prompts, repetition_penalty=1.3)
    longest = max(len(p) for p in prompts) + MAX_NEW
    llm = _engine(loaded, max_num_batched_tokens=64, num_kv_blocks=-(-longest // 16) + 2,
                  admission_reserve_tokens=0)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, repetition_penalty=1.3)
    results = llm.generate(prompts, params)
    assert llm.engine.stats().num_preemptions > 0, "the small pool forced no preemption"
    plain = llm.generate(prompts, _params())
    ties = _compare(results, refs)
    print(f"near ties: {ties}")
    assert sum(a.token_ids != b.token_ids for a, b in zip(results, plain)) >= 3, "the penalty changed nothing"
