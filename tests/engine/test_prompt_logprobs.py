"""Prompt logprobs (engine/prompt_logprobs.py) against transformers' unpaged forward.

Real: the engine on the tiny random Llama (paged KV, scheduler, chunked prefill, prefix cache,
preemption) and transformers' log-softmax over the whole prompt at once.
"""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine.sampling import SamplingParams
from tests.support.tiny_engine import PROMPTS, tiny_engine


@pytest.fixture(scope="module")
def reference(model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for p in PROMPTS:
            out.append(torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), dim=-1))
    return out


@pytest.mark.parametrize("cfg", [{}, {"max_num_batched_tokens": 8}, {"num_kv_blocks": 30, "admission_reserve_tokens": 0}])
def test_prompt_logprobs_equal_transformers_in_every_mode(model_dir, loaded, reference, cfg):
    """Plain, 8-token chunks, and a pool small enough to preempt; the shared 40-token prefix is
    cached first, and a scored request still scores it (it takes no prefix hits)."""
    cfg.setdefault("num_kv_blocks", 64)
    llm = tiny_engine(model_dir, loaded, **cfg)
    llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, temperature=0.0))  # cache the prefix
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    for prompt, ref, res in zip(PROMPTS, reference, llm.generate(PROMPTS, params)):
        got = res.prompt_logprobs
        assert [e.token_id for e in got] == prompt[1:]
        want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        torch.testing.assert_close(torch.tensor([e.logprob for e in got]), want, rtol=0, atol=1e-4)
        top = ref[:-1].topk(3, dim=-1)
        assert [[t for t, _ in e.top] for e in got] == top.indices.tolist()
    llm.engine.check_integrity()
    if cfg["num_kv_blocks"] == 30:
        assert llm.engine.stats().num_preemptions > 0


def test_only_scored_requests_skip_the_prefix_cache(model_dir, loaded):
    llm = tiny_engine(model_dir, loaded, num_kv_blocks=64)
    llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, temperature=0.0))
    plain, scored = llm.generate([PROMPTS[1]] * 2, [SamplingParams(max_tokens=2, temperature=0.0),
                                                     SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=0)])
    assert plain.num_cached_tokens == 40 and scored.num_cached_tokens == 0
    assert plain.token_ids == scored.token_ids
