"""The scheduler's admission reserve (``reserve_tokens``), without a model: what it reserves, and
its invariant that running requests are not preempted for new ones. Real: the scheduler and the
KV cache manager; the model's tokens are a constant."""

from __future__ import annotations

import random

import pytest

from kvmesh.engine.block_hash import extra_key
from kvmesh.engine.kv.kv_manager import KVCacheManager
from kvmesh.engine.outputs import RequestMetrics
from kvmesh.engine.request import Request, RequestStatus
from kvmesh.engine.roles import PrefillHandoff
from kvmesh.engine.sampling import SamplingParams
from kvmesh.engine.scheduler import Scheduler

BS = 4


def _req(rid: str, n: int, seq: int, max_tokens: int, base: int = 10) -> Request:
    return Request(rid, [base + i for i in range(n)], SamplingParams(max_tokens=max_tokens),
                   RequestMetrics(arrival_time=float(seq)), arrival_seq=seq)


def _sched(num_blocks: int, reserve: int, budget: int = 64, max_seqs: int = 8) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, True, extra_key("m", "float32"))
    return Scheduler(kv, max_seqs, budget, reserve_tokens=reserve)


def _drive(s: Scheduler, reqs: list[Request], max_steps: int = 2000) -> tuple[int, list[int]]:
    """Run to completion (each request stops at its max_tokens); (preemptions, running per step)."""
    for r in reqs:
        s.add(r)
    preemptions, running = 0, []
    for _ in range(max_steps):
        if not s.has_unfinished():
            return preemptions, running
        out = s.schedule()
        s.update_after_step(out)
        preemptions += len(out.preempted)
        for seq in out.seqs:
            if seq.produces_token:
                seq.request.append_token(7)
                if len(seq.request.output_token_ids) >= seq.request.params.max_tokens:
                    s.finish(seq.request, "length")
        running.append(s.num_running)
        s.kv.check_integrity()
    raise AssertionError("workload did not finish")


def test_without_a_reserve_growth_preempts_and_with_one_the_newcomer_waits():
    # 10 blocks: two 12-token prompts (3 blocks each) fit, but not their 16 generated tokens each.
    def workload():
        return [_req("a", 12, 0, 16), _req("b", 12, 1, 16, base=100)]

    preempted, _ = _drive(_sched(10, reserve=0), workload())
    assert preempted > 0
    reqs = workload()
    preempted, running = _drive(_sched(10, reserve=16), reqs)
    assert preempted == 0 and max(running) == 1, "b waits for a's blocks instead of taking them"
    assert all(len(r.output_token_ids) == 16 and r.num_preemptions == 0 for r in reqs)


def test_an_idle_engine_admits_the_head_even_when_its_reserve_does_not_fit():
    s = _sched(5, reserve=64)  # 20 token slots
    r = _req("a", 16, 0, 4)  # 4 blocks, its 4 tokens need a fifth: fits, its 64-token reserve would not
    s.add(r)
    s.schedule()
    assert r.status is RequestStatus.RUNNING


def test_reserve_stops_at_max_tokens_and_a_prefill_handoff_at_its_first_token():
    s = _sched(64, reserve=128)
    short = _req("short", 8, 0, 4)
    assert s._reserve_blocks(short, held_blocks=2) == 1  # 8 + 4 tokens: 3 blocks, 2 held
    long_ = _req("long", 8, 1, 1000)
    assert s._reserve_blocks(long_, held_blocks=2) == s.kv.num_blocks_for(8 + 128) - 2
    handoff = _req("p", 8, 2, 1000)
    handoff.handoff = PrefillHandoff()
    assert s._reserve_blocks(handoff, held_blocks=2) == 1  # the first token's slot: 9 tokens, 3 blocks
    assert _sched(64, reserve=0)._reserve_blocks(long_, held_blocks=0) == 0


def test_a_prompt_being_prefilled_reserves_its_remaining_chunks():
    s = _sched(16, reserve=4, budget=8)  # a 40-token prompt in 8-token chunks needs 10 blocks + 1
    a = _req("a", 40, 0, 4)
    s.add(a)
    s.update_after_step(s.schedule())  # a holds 2 blocks, 38 tokens to go
    b = _req("b", 20, 1, 4, base=100)  # 5 blocks + 1: 2 + 11 + 6 > 16
    s.add(b)
    out = s.schedule()
    assert [q.request.request_id for q in out.seqs] == ["a"] and b.status is RequestStatus.WAITING


def test_refuses_a_negative_reserve():
    with pytest.raises(ValueError, match="reserve_tokens"):
        _sched(8, reserve=-1)


def _random_workload(seed: int, with_reserve: bool) -> tuple[int, list[Request]]:
    """(preemptions, requests) of a seeded workload in which no request generates more than the
    reserve, run with that reserve or with none."""
    rng = random.Random(seed)
    reserve = rng.choice([8, 16, 32])
    blocks = rng.randint(12, 40)
    spec = []
    for i in range(rng.randint(2, 14)):
        max_tokens = rng.randint(1, reserve)
        prompt = rng.randint(1, BS * blocks - max_tokens - 1)  # one request alone always fits
        spec.append((f"r{i}", prompt, i, max_tokens, rng.choice([10, 10, 500, 900])))
    budget, max_seqs = rng.choice([8, 16, 64]), rng.randint(1, 8)
    reqs = [_req(*x[:4], base=x[4]) for x in spec]
    preempted, _ = _drive(_sched(blocks, reserve if with_reserve else 0, budget=budget, max_seqs=max_seqs), reqs)
    return preempted, reqs


@pytest.mark.parametrize("seed", range(40))
def test_random_workloads_within_the_reserve_never_preempt(seed):
    """Invariant: when no request generates more than the reserve, none is ever preempted, and all
    finish with every token."""
    preempted, reqs = _random_workload(seed, with_reserve=True)
    assert preempted == 0
    assert all(len(r.output_token_ids) == r.params.max_tokens for r in reqs)


def test_the_same_workloads_preempt_without_the_reserve():
    """The control: the workloads above are tight enough that without the reserve most preempt."""
    preempting = sum(_random_workload(seed, with_reserve=False)[0] > 0 for seed in range(40))
    assert preempting >= 20
