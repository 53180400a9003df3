"""Engine limits and failure handling on a tiny random model (fast, no download):
what add_request rejects, that a failed call leaves nothing behind, that a
failing step finishes its requests with an error, and honest prefix statistics."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import (
    EmptyPromptError,
    InvalidPromptError,
    LLMEngine,
    PromptTooLongError,
)
from kvmesh.engine.llm import LLM, EngineStalledError, RequestFailedError
from kvmesh.engine.sampling import InvalidSamplingParams, SamplingParams
from kvmesh.engine.scheduler import SchedulerOutput

from tests.support.tiny_models import make_tiny_hf_model


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from kvmesh.engine.model.loader import load_model

    return load_model(str(make_tiny_hf_model("llama", tmp_path_factory.mktemp("tiny"))), torch.float32)


def _llm(loaded, **cfg) -> LLM:
    copy = dataclasses.replace(loaded, weights=dict(loaded.weights))
    config = EngineConfig(model=loaded.source, dtype="float32", device="cpu", **cfg)
    return LLM(engine=LLMEngine(config, loaded=copy, debug_checks=True))


GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _prompt(i: int, n: int) -> list[int]:
    return [(7 * i + 3 * j) % 900 + 10 for j in range(n)]


# ---- item 1: a prompt that can never be scheduled -----------------------------------------------------

def test_chunked_prefill_off_rejects_prompt_over_step_budget(loaded):
    llm = _llm(loaded, enable_chunked_prefill=False, max_num_batched_tokens=16)
    with pytest.raises(PromptTooLongError, match="max_num_batched_tokens=16"):
        llm.engine.add_request("long", _prompt(0, 20), GREEDY)
    [r] = llm.generate([_prompt(1, 2)], GREEDY)  # nothing blocks the queue
    assert len(r.token_ids) == 4 and not llm.engine.has_unfinished_requests()


def test_chunked_prefill_off_recomputes_preempted_request_longer_than_budget(loaded):
    """Prompt fits the budget but prompt + generated tokens do not: after preemption it must still finish."""
    prompts = [_prompt(i, 14) for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    ref = _llm(loaded).generate(prompts, params)
    llm = _llm(loaded, enable_chunked_prefill=False, max_num_batched_tokens=16, block_size=4, num_kv_blocks=10,
               admission_reserve_tokens=0,
               enable_prefix_caching=False)
    got = llm.generate(prompts, params)
    assert llm.engine.stats().num_preemptions > 0
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]


def test_generate_fails_loudly_when_engine_makes_no_progress(loaded, monkeypatch):
    llm = _llm(loaded)
    calls = 0

    def nothing(now: float | None = None) -> SchedulerOutput:
        nonlocal calls
        calls += 1
        if calls > 1000:
            raise AssertionError("LLM.generate kept stepping an engine that makes no progress")
        return SchedulerOutput()

    real = llm.engine.scheduler.schedule
    monkeypatch.setattr(llm.engine.scheduler, "schedule", nothing)
    with pytest.raises(EngineStalledError, match="no progress"):
        llm.generate([_prompt(0, 5)], GREEDY)
    monkeypatch.setattr(llm.engine.scheduler, "schedule", real)
    [r] = llm.generate([_prompt(1, 5)], GREEDY)  # the stalled request was aborted, not left behind
    assert len(r.token_ids) == 4 and not llm.engine.has_unfinished_requests()


# ---- item 2: a failed call leaves no orphans --------------------------------------------------------

def test_failed_generate_leaves_no_orphan_requests(loaded):
    llm = _llm(loaded)
    free = llm.engine.stats().num_free_blocks
    with pytest.raises(PromptTooLongError):
        llm.generate([[5, 6, 7, 8, 9], [5] * 600])
    assert not llm.engine.has_unfinished_requests()
    [r] = llm.generate([[11, 12, 13]], GREEDY)
    assert len(r.token_ids) == 4
    assert llm.engine.stats().num_free_blocks == free


# ---- item 3: prefix statistics count each admission once ----------------------------------------------

def test_prefix_stats_count_each_request_once_despite_admission_retries(loaded):
    prompts = [_prompt(i, 40) for i in range(12)]
    # 4-token blocks, room for about two requests at a time: the head of the queue retries
    # admission on many steps before it fits.
    llm = _llm(loaded, block_size=4, num_kv_blocks=24)
    kv, lookups = llm.engine.kv, 0
    real = kv.get_computed_blocks

    def counted(*args, **kwargs):
        nonlocal lookups
        lookups += 1
        return real(*args, **kwargs)

    kv.get_computed_blocks = counted
    llm.generate(prompts, GREEDY)
    assert lookups > len(prompts), "no admission was retried; the test does not exercise retries"
    s = llm.engine.stats()
    assert (s.prefix_queries, s.prefix_hits) == (40 * 12, 0)
    again = llm.generate(prompts[:2], GREEDY)
    s = llm.engine.stats()
    assert s.prefix_queries == 40 * 14
    assert s.prefix_hits == sum(r.num_cached_tokens for r in again)


# ---- item 5: types checked at the door; a failing step finishes its requests ------------------------

@pytest.mark.parametrize("field, value", [
    ("logprobs", 1.5), ("logprobs", True), ("max_tokens", True), ("max_tokens", 2.0), ("top_k", True),
    ("top_k", 0), ("top_k", 2.5), ("seed", 1.5), ("seed", True), ("temperature", "1"),
    ("temperature", float("nan")), ("top_p", None), ("stop_token_ids", [2.0]), ("ignore_eos", 1),
])
def test_sampling_params_reject_wrong_types(field, value):
    with pytest.raises(InvalidSamplingParams, match=f"^{field}"):
        SamplingParams(**{field: value}).validate()


def test_sampling_params_accept_valid_values():
    SamplingParams(max_tokens=1, temperature=1, top_p=1, top_k=-1, seed=0, logprobs=0, stop=("x",)).validate()
    SamplingParams(top_k=5, seed=-3, temperature=0.0).validate()


@pytest.mark.parametrize("prompt, error, match", [
    ([5.0, 6], InvalidPromptError, "integers, got 5.0"),
    ([True, 6], InvalidPromptError, "bool"),
    (["5"], InvalidPromptError, "integers"),
    ("hello", InvalidPromptError, "list of token ids"),
    ([5, 1000], InvalidPromptError, r"\[0, 1000\), got 1000"),
    ([-1], InvalidPromptError, "got -1"),
    ([], EmptyPromptError, "empty"),
])
def test_add_request_rejects_bad_prompts_and_engine_stays_healthy(loaded, prompt, error, match):
    llm = _llm(loaded)
    with pytest.raises(error, match=match):
        llm.engine.add_request("bad", prompt, GREEDY)
    assert not llm.engine.has_unfinished_requests()
    [r] = llm.generate([[5, 6]], GREEDY)
    assert len(r.token_ids) == 4


def test_empty_prompt_is_not_a_too_long_prompt():
    assert not issubclass(EmptyPromptError, PromptTooLongError)


def test_failing_step_finishes_its_requests_with_an_error(loaded, monkeypatch):
    llm = _llm(loaded)
    eng = llm.engine
    free = eng.stats().num_free_blocks
    eng.add_request("a", [5, 6, 7], GREEDY)
    eng.add_request("b", [8, 9], GREEDY)

    def boom(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(eng.runner, "execute", boom)
    outs = eng.step()
    assert sorted((o.request_id, o.finish_reason) for o in outs) == [("a", "error"), ("b", "error")]
    assert all(o.finished and "kernel exploded" in o.error for o in outs)
    assert not eng.has_unfinished_requests() and eng.scheduler.num_running == 0
    assert eng.stats().num_free_blocks == free
    with pytest.raises(RequestFailedError, match="kernel exploded"):
        llm.generate([[5, 6]], GREEDY)
    monkeypatch.undo()
    [r] = llm.generate([[5, 6]], GREEDY)
    assert len(r.token_ids) == 4 and not eng.has_unfinished_requests()


# ---- item 6: the engine seed --------------------------------------------------------------------------

def _sampled(loaded, seed: int) -> list[list[int]]:
    p = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    return [r.token_ids for r in _llm(loaded, seed=seed).generate([_prompt(0, 6), _prompt(1, 9)], p)]


def test_engine_seed_makes_unseeded_sampling_reproducible(loaded):
    torch.manual_seed(0)
    a = _sampled(loaded, seed=1)
    torch.manual_seed(99)  # the global generator plays no part
    assert _sampled(loaded, seed=1) == a
    assert _sampled(loaded, seed=2) != a
