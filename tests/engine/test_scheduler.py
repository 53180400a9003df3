"""Scheduler behaviour without a model: budget, chunking, ordering, preemption."""

from __future__ import annotations

import random

import pytest

from kvmesh.engine.block_hash import extra_key
from kvmesh.engine.kv.kv_manager import KVCacheManager
from kvmesh.engine.outputs import RequestMetrics
from kvmesh.engine.request import Request, RequestStatus
from kvmesh.engine.sampling import SamplingParams
from kvmesh.engine.roles import PrefillHandoff
from kvmesh.engine.scheduler import Scheduler, chunk_tokens

BS = 4


def _req(rid: str, n: int, seq: int, priority: int = 0, base: int = 10) -> Request:
    return Request(rid, [base + i for i in range(n)], SamplingParams(max_tokens=100),
                   RequestMetrics(arrival_time=float(seq)), priority=priority, arrival_seq=seq)


def _sched(num_blocks=64, budget=32, max_seqs=8, caching=True) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, caching, extra_key("m", "float32"))
    return Scheduler(kv, max_seqs, budget)


def _run_step(s: Scheduler, next_token: int = 7):
    out = s.schedule()
    s.update_after_step(out)
    for seq in out.seqs:
        if seq.produces_token:
            seq.request.append_token(next_token)
    s.kv.check_integrity()
    return out


def test_chunked_prefill_respects_budget_and_finishes_prompt():
    s = _sched(budget=10)
    r = _req("a", 25, 0)
    s.add(r)
    chunks = []
    while not r.output_token_ids:
        out = _run_step(s)
        assert out.num_batched_tokens <= 10
        chunks.append(out.seqs[0].num_new_tokens)
    assert chunks == [10, 10, 5]
    assert r.num_computed_tokens == 25 and r.num_tokens == 26


def test_decodes_first_and_mixed_with_prefill():
    s = _sched(budget=16)
    a = _req("a", 5, 0)
    s.add(a)
    _run_step(s)  # a prefilled, produced one token
    b = _req("b", 30, 1, base=100)
    s.add(b)
    out = _run_step(s)
    assert [x.request.request_id for x in out.seqs] == ["a", "b"]
    assert out.num_decodes == 1 and out.seqs[1].num_new_tokens == 15


def _after_cached(n_cached: int, n_prompt: int):
    """(scheduler, the step that admits b, b): request a's ``n_cached`` tokens computed and finished
    (its full blocks cached), then b, whose prompt of ``n_prompt`` tokens starts with them."""
    s = _sched()
    a = _req("a", n_cached, 0)
    s.add(a)
    _run_step(s)
    s.finish(a, "stop")
    b = _req("b", n_prompt, 1)
    s.add(b)
    return s, _run_step(s), b


def test_prefix_hit_skips_cached_tokens():
    _, out, b = _after_cached(12, 14)  # same first 12 tokens
    assert b.num_cached_tokens == 12 and out.seqs[0].num_new_tokens == 2


def test_full_prompt_hit_still_computes_last_token():
    s, out, b = _after_cached(12, 12)
    # Every block hit: only the last token runs again (for its logits), its KV already cached.
    seq = out.seqs[0]
    assert (seq.num_new_tokens, seq.num_cached_new, seq.num_computed_tokens) == (1, 1, 11)
    assert b.num_cached_tokens == 11 and b.output_token_ids == [7] and len(s.kv.block_ids("b")) == 3


def test_a_hit_short_of_the_last_block_recomputes_the_block_as_before():
    _, out, b = _after_cached(12, 13)  # one token past a's cached blocks: no token is run twice
    assert (out.seqs[0].num_new_tokens, out.seqs[0].num_cached_new, b.num_cached_tokens) == (1, 0, 12)


def test_preemption_picks_lowest_priority_latest_arrival_and_recomputes():
    s = _sched(num_blocks=6, budget=64)  # 24 token slots
    hi = _req("hi", 8, 0, priority=0)
    lo_early = _req("lo_early", 4, 1, priority=1, base=200)
    lo_late = _req("lo_late", 4, 2, priority=1, base=300)
    for r in (hi, lo_early, lo_late):
        s.add(r)
    _run_step(s)  # 2 + 1 + 1 blocks used, each has one output token
    preempted = []
    for _ in range(12):
        out = _run_step(s)
        preempted += [r.request_id for r in out.preempted]
        if preempted:
            break
    assert preempted[0] == "lo_late"
    assert lo_late.status is RequestStatus.WAITING and lo_late.num_computed_tokens == 0
    assert lo_late.output_token_ids, "generated tokens survive preemption"
    assert s.num_preemptions >= 1


def test_abort_frees_blocks_at_once():
    s = _sched(num_blocks=16)
    r = _req("a", 20, 0)
    s.add(r)
    _run_step(s)
    assert s.kv.num_free_blocks < 16
    s.finish(r, "abort")
    assert s.kv.num_free_blocks == 16
    assert not s.has_unfinished()
    s.kv.check_integrity()


def test_random_workload_keeps_integrity_and_completes():
    rng = random.Random(0)
    s = _sched(num_blocks=24, budget=20, max_seqs=6)
    reqs = [_req(f"r{i}", rng.randint(1, 30), i, priority=rng.randint(0, 2), base=rng.choice([10, 10, 500]))
            for i in range(25)]
    for r in reqs:
        s.add(r)
    target = {r.request_id: rng.randint(1, 12) for r in reqs}
    steps = 0
    while s.has_unfinished():
        steps += 1
        assert steps < 5000
        out = s.schedule()
        assert out.num_batched_tokens <= 20 and len(s.running) <= 6
        s.update_after_step(out)
        for seq in out.seqs:
            r = seq.request
            if seq.produces_token:
                r.append_token(rng.randint(10, 20))
                if len(r.output_token_ids) >= target[r.request_id]:
                    s.finish(r, "length")
        s.kv.check_integrity()
    assert all(len(r.output_token_ids) == target[r.request_id] for r in reqs)
    assert s.kv.num_free_blocks == 24


def test_queued_prefill_tokens_count_waiting_and_partly_prefilled_prompts():
    s = _sched(budget=10, max_seqs=1)
    a, b = _req("a", 25, 0), _req("b", 7, 1, base=100)
    s.add(a)
    s.add(b)
    assert s.queued_prefill_tokens == 32
    _run_step(s)  # 10 tokens of a computed; b still waits (one sequence at a time)
    assert s.queued_prefill_tokens == 22
    s.finish(b, "abort")
    assert s.queued_prefill_tokens == 15
    while not a.output_token_ids:
        _run_step(s)
    assert s.queued_prefill_tokens == 0


@pytest.mark.parametrize("computed,total,budget,tail,want", [
    (0, 25, 10, 0, 10),    # no tail: the budget cuts
    (20, 25, 10, 0, 5),
    (0, 25, 32, 8, 16),    # would finish: stop at the last boundary at or before 25 - 8 = 17
    (16, 25, 32, 8, 9),    # the tail itself: 9 < 8 + one block
    (0, 25, 10, 8, 10),    # the budget cuts first; the tail comes when the end is in reach
    (10, 25, 20, 8, 15),   # 10 -> 16 is less than a tail's worth: not a step of its own
    (0, 6, 32, 8, 6),      # a prompt shorter than the tail is one chunk
    (0, 1, 32, 8, 1),      # a decode token is never cut
    (17, 25, 32, 8, 8),    # past the boundary already: nothing to split off
])
def test_chunk_tokens_cuts_the_last_chunk_to_the_tail(computed, total, budget, tail, want):
    assert chunk_tokens(computed, total, budget, BS, tail) == want


def test_a_streamed_handoff_computes_every_block_before_its_tail_one_step_early():
    """Prefill role: a 50-token prompt under a 32-token budget with an 8-token tail runs 32, then
    8 (to the boundary at 40 <= 50 - 8), then the 10-token tail, whose step samples the token;
    a plain request with the same prompt runs 32 + 18."""
    def chunks(req: Request) -> list[int]:
        s = _sched(budget=32)
        s.add(req)
        out = []
        while not req.output_token_ids:
            out.append(_run_step(s).seqs[0].num_new_tokens)
        return out

    streamed = _req("a", 50, 0)
    streamed.handoff = PrefillHandoff(stream=True, tail_tokens=8)
    assert chunks(streamed) == [32, 8, 10]
    assert chunks(_req("b", 50, 0)) == [32, 18]
    unstreamed = _req("c", 50, 0)
    unstreamed.handoff = PrefillHandoff(stream=False, tail_tokens=8)
    assert chunks(unstreamed) == [32, 18]
