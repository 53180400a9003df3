"""Greedy parity of the hybrid (Qwen3.5 text) engine with transformers fp32, token for token.

Real: the whole engine (scheduler, paged KV for the attention layer, state slots for the three
gated DeltaNet layers, sampler) on a tiny random Qwen3_5ForCausalLM written by transformers,
and transformers' own generate (chunked prefill, recurrent decode) as the reference. Only the
weights are random and small; the LM head is scaled so greedy choices are not near ties.
"""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.llm import LLM
from kvmesh.engine.sampling import SamplingParams
from tests.support.tiny_hybrid import hf_greedy, make_tiny_hybrid_model

MAX_NEW = 16
_g = torch.Generator().manual_seed(1)
# A 1-token prompt (scheduled as a "decode" row with no state yet), short, and longer than a
# 64-token DeltaNet chunk and several 16-token KV blocks.
PROMPTS = [torch.randint(3, 1000, (n,), generator=_g).tolist() for n in (1, 5, 37, 70, 130)]


@pytest.fixture(scope="module")
def reference(hybrid_dir):
    return hf_greedy(hybrid_dir, PROMPTS, MAX_NEW)


def _llm(hybrid_dir, **cfg) -> LLM:
    # A pool of 256 blocks: the integrity checks after every step walk all of it.
    cfg = {"num_kv_blocks": 256, **cfg}
    return LLM(engine=LLMEngine(EngineConfig(model=str(hybrid_dir), dtype="float32", **cfg), debug_checks=True))


def _params(n: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _assert_parity(results, reference):
    for i, (res, (want, scores)) in enumerate(zip(results, reference)):
        top2 = scores.topk(2).values
        assert res.token_ids == want, (
            f"prompt {i} (len {len(PROMPTS[i])}): kvmesh {res.token_ids} != transformers {want}; "
            f"smallest top-2 gap in the reference {float((top2[:, 0] - top2[:, 1]).min()):.3g}")


def test_cold(hybrid_dir, reference):
    """All prompts at once (prefills of different lengths share one padded chunked scan)."""
    _assert_parity(_llm(hybrid_dir).generate(PROMPTS, _params()), reference)


@pytest.mark.parametrize("budget", [7, 23])
def test_chunked_prefill_budgets(hybrid_dir, reference, budget):
    """Step budgets that are not block (16) or DeltaNet-chunk (64) multiples: prompts resume from slot state."""
    _assert_parity(_llm(hybrid_dir, max_num_batched_tokens=budget).generate(PROMPTS, _params()), reference)


def test_preemption_recomputes_state(hybrid_dir, reference):
    """A KV pool too small for all requests forces preemption; the victims restart from token 0."""
    llm = _llm(hybrid_dir, num_kv_blocks=13, max_num_batched_tokens=64, admission_reserve_tokens=0)
    results = llm.generate(PROMPTS, _params())
    assert llm.engine.stats().num_preemptions > 0, "the tiny pool forced no preemption"
    _assert_parity(results, reference)


def test_batch_mixing_new_and_decoding_requests(hybrid_dir, reference):
    """Requests join while others decode: steps carry decode rows and prefill rows together."""
    engine = LLMEngine(EngineConfig(model=str(hybrid_dir), dtype="float32", max_num_batched_tokens=40,
                                    num_kv_blocks=256), debug_checks=True)
    shapes = []
    execute = engine.runner.execute

    def spy(out, block_ids, slots=None):
        shapes.append((out.num_decodes, len(out.seqs)))
        return execute(out, block_ids, slots)

    engine.runner.execute = spy
    got: dict[str, list[int]] = {}
    pending = list(enumerate(PROMPTS))
    for step in range(400):
        if pending and step % 3 == 0:
            i, p = pending.pop(0)
            engine.add_request(str(i), p, _params())
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.output_token_ids
        if not pending and not engine.has_unfinished_requests():
            break
    assert any(0 < nd < n for nd, n in shapes), f"no step mixed decodes and prefills: {shapes}"
    for i, (want, _) in enumerate(reference):
        assert got[str(i)] == want, f"prompt {i}: {got[str(i)]} != {want}"


def test_repeated_prompts_hit_only_with_checkpoints(hybrid_dir, reference):
    """A repeated prompt: with no checkpoint memory no hit at all (the KV would be there, the DeltaNet
    state would not); with checkpoints a hit up to the prompt's last block boundary. Both exact."""
    off = _llm(hybrid_dir, state_checkpoint_bytes=0)
    off.generate(PROMPTS, _params())
    again = off.generate(PROMPTS, _params())
    assert all(r.num_cached_tokens == 0 for r in again)
    _assert_parity(again, reference)
    on = _llm(hybrid_dir)
    on.generate(PROMPTS, _params())
    again = on.generate(PROMPTS, _params())
    assert [r.num_cached_tokens for r in again] == [(len(p) - 1) // 16 * 16 for p in PROMPTS]
    _assert_parity(again, reference)


@pytest.mark.slow  # a larger random hybrid model against transformers
def test_larger_random_model(tmp_path):
    """A larger random Qwen3.5 (8 layers, hidden 256, 2 attention layers): long prompts, chunked
    prefill at a budget that is not a block multiple, 48 greedy tokens each, against transformers."""
    d = make_tiny_hybrid_model(tmp_path, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
                               linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32,
                               head_scale=8.0)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (3, 150, 333)]
    reference = hf_greedy(d, prompts, 48)
    for cfg in ({}, {"max_num_batched_tokens": 100}):
        llm = _llm(d, **cfg)
        results = llm.generate(prompts, _params(48))
        for i, (res, (want, _)) in enumerate(zip(results, reference)):
            assert res.token_ids == want, f"{cfg} prompt {i}: {res.token_ids} != {want}"
