"""Logit controls (engine/logits_processing.py) against a plain per-row reference, on random
logits and random token histories (no model). Real: the processor and its count table."""

from __future__ import annotations

import random

import pytest
import torch

from kvmesh.engine.logits_processing import LogitsProcessor
from kvmesh.engine.outputs import RequestMetrics
from kvmesh.engine.request import Request
from kvmesh.engine.sampling import InvalidSamplingParams, SamplingParams

VOCAB = 64
EOS = (2,)


def _request(rid: str, prompt: list[int], output: list[int], **params) -> Request:
    req = Request(rid, list(prompt), SamplingParams(max_tokens=50, **params).validate(), RequestMetrics(0.0))
    for t in output:
        req.append_token(t)
    return req


def _reference(logits: torch.Tensor, req: Request) -> torch.Tensor:
    """One row, written the slow, obvious way."""
    p = req.params
    row = [float(x) for x in logits]
    if p.allowed_token_ids:
        row = [x if t in p.allowed_token_ids else float("-inf") for t, x in enumerate(row)]
    for t, b in p.logit_bias.items():
        row[t] += b
    if len(req.output_token_ids) < p.min_tokens:
        for t in (*EOS, *p.stop_token_ids):
            row[t] = float("-inf")
    out = req.output_token_ids
    for word in p.bad_words_token_ids:
        *head, last = word
        if len(head) <= len(out) and (not head or out[len(out) - len(head):] == head):
            row[last] = float("-inf")
    seen = set(req.prompt_token_ids) | set(req.output_token_ids)
    for t in range(len(row)):
        if t in seen and p.repetition_penalty != 1.0:
            row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
        c = req.output_token_ids.count(t)
        row[t] -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
    return torch.tensor(row)


def _random_request(rng: random.Random, i: int) -> Request:
    params: dict = {}
    if rng.random() < 0.6:
        params["presence_penalty"] = rng.uniform(-2, 2)
    if rng.random() < 0.6:
        params["frequency_penalty"] = rng.uniform(-2, 2)
    if rng.random() < 0.5:
        params["repetition_penalty"] = rng.uniform(0.5, 2)
    if rng.random() < 0.4:
        params["logit_bias"] = {rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(rng.randrange(1, 6))}
    if rng.random() < 0.3:
        params["min_tokens"] = rng.randrange(0, 8)
        params["stop_token_ids"] = [rng.randrange(VOCAB)]
    if rng.random() < 0.2:
        params["allowed_token_ids"] = rng.sample(range(VOCAB), rng.randrange(1, 10))
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 20))]
    output = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 12))]
    if rng.random() < 0.4:
        params["bad_words_token_ids"] = [_bad_word(rng, output) for _ in range(rng.randrange(1, 5))]
    return _request(f"r{i}", prompt, output, **params)


def _bad_word(rng: random.Random, output: list[int]) -> list[int]:
    """A token sequence that often continues `output` (its head is the output's tail), sometimes
    nearly (one token off), sometimes not at all."""
    k = rng.randrange(0, min(len(output), 4) + 1)
    head = output[len(output) - k:] if k else []
    if head and rng.random() < 0.25:
        head = [*head[:-1], (head[-1] + 1) % VOCAB]
    if rng.random() < 0.2:
        head = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 6))]
    return [*head, rng.randrange(VOCAB)]


@pytest.mark.parametrize("seed", range(8))
def test_batched_controls_equal_the_per_row_reference(seed):
    rng = random.Random(seed)
    reqs = [_random_request(rng, i) for i in range(rng.randrange(1, 12))]
    logits = torch.randn(len(reqs), VOCAB, generator=torch.Generator().manual_seed(seed)) * 5
    proc = LogitsProcessor(VOCAB, EOS, torch.device("cpu"))
    got = proc.apply(logits.clone(), reqs)
    for i, req in enumerate(reqs):
        torch.testing.assert_close(got[i], _reference(logits[i], req), rtol=1e-5, atol=1e-4)


def test_counts_follow_the_tokens_recorded_each_step():
    """The table is seeded from the tokens a request already has and then kept by record():
    after several steps it matches the reference built from the whole history."""
    rng = random.Random(7)
    reqs = [_request(f"r{i}", [1, 3, 5], [4] * i, frequency_penalty=0.5, presence_penalty=0.25,
                     repetition_penalty=1.5) for i in range(3)]
    proc = LogitsProcessor(VOCAB, EOS, torch.device("cpu"))
    for _ in range(6):
        logits = torch.randn(len(reqs), VOCAB)
        got = proc.apply(logits.clone(), reqs)
        for i, req in enumerate(reqs):
            torch.testing.assert_close(got[i], _reference(logits[i], req), rtol=1e-5, atol=1e-4)
        tokens = [rng.randrange(VOCAB) for _ in reqs]
        for req, t in zip(reqs, tokens):
            req.append_token(t)
        proc.record(reqs, tokens)


def test_rows_are_reused_after_release_and_the_table_grows():
    proc = LogitsProcessor(VOCAB, EOS, torch.device("cpu"))
    many = [_request(f"r{i}", [i % VOCAB], [i % VOCAB], presence_penalty=1.0) for i in range(20)]
    proc.apply(torch.zeros(20, VOCAB), many)
    assert len(proc.table.rows) == 20 and proc.table.counts.shape[0] >= 20
    for req in many[:10]:
        proc.release(req.request_id)
    again = _request("new", [0], [], presence_penalty=1.0)
    out = proc.apply(torch.zeros(1, VOCAB), [again])
    # A reused row starts from the new request's own (empty) history, not its last owner's.
    assert torch.equal(out[0], torch.zeros(VOCAB))
    assert len(proc.table.rows) == 11


def test_a_bad_word_is_banned_once_its_head_was_generated():
    """"bad" = tokens 5, 6, 7: token 7 is banned right after 5, 6 and only then; a one-token word
    (9) always is; nothing else moves."""
    req = _request("r", [1], [], bad_words_token_ids=[[5, 6, 7], [9]])
    proc = LogitsProcessor(VOCAB, EOS, torch.device("cpu"))
    banned = []
    for t in (5, 6, 8, 5, 6):
        row = proc.apply(torch.zeros(1, VOCAB), [req])[0]
        banned.append(sorted(int(x) for x in torch.nonzero(row == float("-inf"))))
        assert torch.count_nonzero(row[torch.isfinite(row)]) == 0
        req.append_token(t)
    row = proc.apply(torch.zeros(1, VOCAB), [req])[0]
    banned.append(sorted(int(x) for x in torch.nonzero(row == float("-inf"))))
    assert banned == [[9], [9], [7, 9], [9], [9], [7, 9]]


def test_requests_without_controls_pass_through_untouched():
    reqs = [_request("plain", [1], [1, 1]), _request("biased", [1], [], logit_bias={3: 5.0})]
    logits = torch.randn(2, VOCAB)
    out = LogitsProcessor(VOCAB, EOS, torch.device("cpu")).apply(logits.clone(), reqs)
    assert torch.equal(out[0], logits[0])
    assert out[1, 3] == pytest.approx(float(logits[1, 3]) + 5.0)
    assert not LogitsProcessor.needed([reqs[0]]) and LogitsProcessor.needed(reqs)


@pytest.mark.parametrize("params, message", [
    ({"presence_penalty": 2.5}, "presence_penalty must be a number in [-2, 2]"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty must be a number in [-2, 2]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be a number in (0, 2]"),
    ({"logit_bias": {5: 101.0}}, "logit_bias values must be numbers in [-100, 100]"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias keys must be non-negative token ids"),
    ({"min_tokens": 51}, "min_tokens must be an integer between 0 and max_tokens (50)"),
    ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list"),
    ({"bad_words_token_ids": [[]]}, "bad_words_token_ids must be at most 200 lists of 1 to 32"),
    ({"bad_words_token_ids": [[1, -2]]}, "bad_words_token_ids must be"),
    ({"bad_words_token_ids": [[1]] * 201}, "bad_words_token_ids must be"),
    ({"bad_words_token_ids": [list(range(33))]}, "bad_words_token_ids must be"),
])
def test_out_of_range_controls_are_refused_with_the_range(params, message):
    with pytest.raises(InvalidSamplingParams) as e:
        SamplingParams(max_tokens=50, **params).validate()
    assert message in str(e.value)
