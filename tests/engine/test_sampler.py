"""Sampler semantics on synthetic logits (no model)."""

from __future__ import annotations

import math

import pytest
import torch

from kvmesh.engine.sampler import sample
from kvmesh.engine.sampling import SamplingParams


@pytest.fixture(autouse=True)
def _seeded_global_rng():
    """Unseeded rows draw from torch's global generator: seed it so every run sees the same draws."""
    state = torch.random.get_rng_state()
    torch.manual_seed(1234)
    yield
    torch.random.set_rng_state(state)


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def test_greedy_is_argmax():
    logits = torch.randn(5, 100)
    res = sample(logits, [SamplingParams(temperature=0.0)] * 5, [None] * 5)
    assert res.token_ids == logits.argmax(-1).tolist()


def test_top_k_one_equals_greedy_and_top_k_restricts():
    logits = torch.randn(3, 50)
    res = sample(logits, [SamplingParams(top_k=1)] * 3, [None] * 3)
    assert res.token_ids == logits.argmax(-1).tolist()
    top3 = set(logits[0].topk(3).indices.tolist())
    for _ in range(50):
        tok = sample(logits[:1], [SamplingParams(top_k=3, temperature=2.0)], [None]).token_ids[0]
        assert tok in top3


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    seen = {sample(logits, [SamplingParams(top_p=0.7)], [None]).token_ids[0] for _ in range(200)}
    assert seen == {0, 1}


def test_min_p_drops_unlikely_tokens():
    logits = torch.tensor([[0.6, 0.3, 0.1]]).log()
    seen = {sample(logits, [SamplingParams(min_p=0.4)], [None]).token_ids[0] for _ in range(200)}
    assert seen == {0, 1}


def test_sampling_follows_distribution():
    probs = torch.tensor([0.7, 0.2, 0.1])
    logits = probs.log().expand(4000, 3).clone()
    res = sample(logits, [SamplingParams(temperature=1.0)] * 4000, [None] * 4000)
    freq = torch.bincount(torch.tensor(res.token_ids), minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def test_seeded_rows_do_not_depend_on_batch():
    logits = torch.randn(4, 1000)
    p = SamplingParams(temperature=1.0, seed=42)
    alone = sample(logits[2:3], [p], [_gen(42)]).token_ids[0]
    batched = sample(logits, [SamplingParams(temperature=1.0)] * 2 + [p, SamplingParams(temperature=0.0)],
                     [None, None, _gen(42), None]).token_ids
    assert batched[2] == alone
    assert batched[3] == int(logits[3].argmax())


def test_logprobs_match_log_softmax():
    logits = torch.randn(2, 30)
    res = sample(logits, [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.0)],
                 [None, None])
    lp = torch.log_softmax(logits[0], -1)
    tl = res.logprobs[0]
    assert tl.token_id == int(lp.argmax()) and math.isclose(tl.logprob, float(lp.max()), rel_tol=1e-5)
    assert [t for t, _ in tl.top] == lp.topk(3).indices.tolist()
    assert res.logprobs[1] is None


@pytest.mark.parametrize("temperature", [1e-38, 1e-30, 1e-8, 1e-3])
def test_tiny_temperature_picks_the_argmax(temperature):
    logits = torch.randn(6, 500) * 30
    logits[5, 7] = logits[5].max() + 1e-3  # a close runner-up must not matter either
    res = sample(logits, [SamplingParams(temperature=temperature)] * 6, [None] * 6)
    assert res.token_ids == logits.argmax(-1).tolist()


def test_tiny_temperature_with_filters_and_bf16():
    logits = (torch.randn(3, 200) * 10).bfloat16()
    params = [SamplingParams(temperature=1e-30, top_k=5), SamplingParams(temperature=1e-30, top_p=0.5),
              SamplingParams(temperature=1e-30, min_p=0.2)]
    assert sample(logits, params, [None] * 3).token_ids == logits.float().argmax(-1).tolist()


def test_default_generator_drives_unseeded_rows():
    logits = torch.zeros(8, 100)
    params = [SamplingParams(temperature=1.0)] * 8
    a = sample(logits, params, [None] * 8, _gen(7)).token_ids
    torch.manual_seed(999)
    assert sample(logits, params, [None] * 8, _gen(7)).token_ids == a
