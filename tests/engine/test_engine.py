"""LLMEngine behaviour on the real default model (bf16): stop conditions,
abort, seeds, logprobs, validation, thread-safe submission."""

from __future__ import annotations

import dataclasses
import gc
import threading
import weakref

import pytest
import torch

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import DuplicateRequestError, LLMEngine, PromptTooLongError
from kvmesh.engine.llm import LLM
from kvmesh.engine.sampling import InvalidSamplingParams, SamplingParams
from tests.support.residency import resident_pages

pytestmark = pytest.mark.slow  # the default model in process


@pytest.fixture(scope="module")
def loaded():
    from kvmesh.engine.model.loader import load_model

    return load_model("default", torch.bfloat16)


def _llm(loaded, **cfg) -> LLM:
    copy = dataclasses.replace(loaded, weights=dict(loaded.weights))
    return LLM(engine=LLMEngine(EngineConfig(dtype="bfloat16", **cfg), loaded=copy, debug_checks=True))


@pytest.fixture(scope="module")
def llm(loaded):
    return _llm(loaded, max_model_len=1024)


CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def test_map_pools_maps_the_kv_cache_and_the_host_tier_and_keeps_serving(loaded):
    """What `kvmesh serve` calls at start-up (engine/server/runtime.py): every page of both
    host-memory pools mapped, read back from the kernel; the engine answers as before."""
    llm = _llm(loaded, num_kv_blocks=256, cpu_kv_bytes=32 << 20)
    eng = llm.engine
    for thread in eng.map_pools():
        thread.join(timeout=60)
    for pool in (eng.runner.kv_cache, eng.tiers.host.data):
        mapped, pages = resident_pages(pool)
        assert mapped == pages > 0
    [r] = llm.chat([CHAT], SamplingParams(temperature=0.0, max_tokens=12))
    assert "Paris" in r.text


def test_dropped_engine_is_freed_without_the_cycle_collector(loaded):
    """Components call back into the engine (eviction, KV events, transfer hooks) through weak
    references: an `LLM` the caller drops frees its engine, KV pool and host tier at once, not
    at the next collection."""
    gc.disable()
    try:
        llm = _llm(loaded, num_kv_blocks=64, cpu_kv_bytes=4 << 20)
        llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=4))
        engine, pool = weakref.ref(llm.engine), weakref.ref(llm.engine.runner.kv_cache)
        del llm
        assert engine() is None and pool() is None
    finally:
        gc.enable()


def test_greedy_answer_and_eos(llm):
    [r] = llm.chat([CHAT], SamplingParams(temperature=0.0, max_tokens=40))
    assert "Paris" in r.text
    assert r.finish_reason == "stop" and r.token_ids[-1] in llm.tokenizer.eos_token_ids


def test_stop_string_truncates_and_streams_nothing_after(llm):
    prompt = llm.tokenizer.apply_chat_template(CHAT)
    [full] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40))
    word = "France"
    assert word in full.text
    eng = llm.engine
    eng.add_request("s1", prompt, SamplingParams(temperature=0.0, max_tokens=40, stop=[word]))
    deltas, final = [], None
    while final is None:
        for out in eng.step():
            deltas.append(out.text_delta)
            if out.finished:
                final = out
    assert final.finish_reason == "stop" and final.stop_reason == word
    assert final.text == full.text[: full.text.index(word)]
    assert "".join(deltas) == final.text


def test_stop_token_ids_and_max_tokens(llm):
    prompt = llm.tokenizer.apply_chat_template(CHAT)
    [full] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert full.finish_reason == "length" and len(full.token_ids) == 12
    stop_tok = full.token_ids[3]
    [r] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                stop_token_ids=[stop_tok]))
    assert r.finish_reason == "stop" and r.stop_reason == stop_tok
    assert r.token_ids == full.token_ids[: full.token_ids.index(stop_tok) + 1]


def test_ignore_eos_runs_to_max_tokens(llm):
    [r] = llm.chat([CHAT], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    assert len(r.token_ids) == 30 and r.finish_reason == "length"


def test_seed_reproducible_regardless_of_batch(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    [alone] = llm.chat([CHAT], p)
    others = [[{"role": "user", "content": f"Tell me about the number {i}."}] for i in range(3)]
    batch = llm.chat(others[:2] + [CHAT] + others[2:],
                     [SamplingParams(temperature=1.0, max_tokens=20)] * 2 + [p]
                     + [SamplingParams(temperature=1.0, max_tokens=20)])
    assert batch[2].token_ids == alone.token_ids


def test_logprobs_returned(llm):
    [r] = llm.chat([CHAT], SamplingParams(temperature=0.0, max_tokens=5, logprobs=2, ignore_eos=True))
    assert len(r.logprobs) == 5
    for tok, lp in zip(r.token_ids, r.logprobs):
        assert lp.token_id == tok and lp.logprob <= 0 and lp.top[0][0] == tok and len(lp.top) == 2


def test_abort_frees_blocks_at_next_step(llm):
    eng = llm.engine
    free0 = eng.stats().num_free_blocks
    prompt = llm.tokenizer.apply_chat_template(CHAT)
    eng.add_request("ab", prompt, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert eng.stats().num_free_blocks < free0
    eng.abort_request("ab")
    outs = eng.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("ab", "abort")]
    assert eng.stats().num_free_blocks == free0
    assert not eng.has_unfinished_requests()


def test_validation_errors(llm):
    eng = llm.engine
    with pytest.raises(PromptTooLongError, match="1024"):
        eng.add_request("long", [5] * 1000, SamplingParams(max_tokens=100))
    with pytest.raises(InvalidSamplingParams, match="top_p"):
        eng.add_request("bad", [5, 6], SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match="token ids"):
        eng.add_request("oob", [10**7], SamplingParams())
    eng.add_request("dup", [5, 6], SamplingParams(max_tokens=1))
    with pytest.raises(DuplicateRequestError):
        eng.add_request("dup", [5, 6], SamplingParams(max_tokens=1))
    while eng.has_unfinished_requests():
        eng.step()


def test_requests_from_other_threads(llm):
    eng = llm.engine
    prompt = llm.tokenizer.apply_chat_template(CHAT)
    threads = [threading.Thread(target=eng.add_request,
                                args=(f"t{i}", prompt, SamplingParams(temperature=0.0, max_tokens=8)))
               for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.output_token_ids
    assert len(done) == 6 and len({tuple(v) for v in done.values()}) == 1
