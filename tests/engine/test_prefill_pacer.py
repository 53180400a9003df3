"""The TPOT pacer alone (pure arithmetic on its learned rates) and inside the scheduler (no model:
steps are simulated, the clock is passed in)."""

from __future__ import annotations

import math

import pytest

from kvmesh.engine.block_hash import extra_key
from kvmesh.engine.config import ConfigError, EngineConfig
from kvmesh.engine.kv.kv_manager import KVCacheManager
from kvmesh.engine.outputs import RequestMetrics
from kvmesh.engine.prefill_pacer import PrefillPacer
from kvmesh.engine.request import Request
from kvmesh.engine.sampling import SamplingParams
from kvmesh.engine.scheduler import Scheduler

BS = 4


def _measured(slo_s: float = 0.1, decode_s: float = 0.05, per_token_s: float = 0.001) -> PrefillPacer:
    p = PrefillPacer(slo_s)
    p.observe(num_decodes=4, prefill_tokens=0, seconds=decode_s)
    p.observe(num_decodes=4, prefill_tokens=100, seconds=decode_s + 100 * per_token_s)
    return p


def test_rates_are_learned_from_decode_only_and_mixed_steps():
    p = _measured()
    assert p.decode_step_s == pytest.approx(0.05)
    assert p.prefill_s_per_token == pytest.approx(0.001)
    p.observe(0, 200, 0.4)  # a prefill-only step: no decode part to take off
    assert p.prefill_s_per_token == pytest.approx(0.75 * 0.001 + 0.25 * 0.002)
    p.observe(0, 0, 1.0)  # an empty step teaches nothing
    p.observe(4, 10, 0.01)  # faster than the decodes alone: no per-token figure from it
    assert p.decode_step_s == pytest.approx(0.05) and p.prefill_s_per_token == pytest.approx(0.00125)


def test_budget_is_the_smallest_slack_less_the_decode_step_in_prompt_tokens():
    p = _measured()
    now = 100.0
    # Stream A: 10 tokens over 0.6 s at a 100 ms target -> 0.4 s of slack; B: 3 tokens over 0.22 s -> 0.08.
    assert p.budget(now, [(now - 0.6, 10)]) == int((0.4 - 0.05) / 0.001)
    assert 29 <= p.budget(now, [(now - 0.6, 10), (now - 0.22, 3)]) <= 30  # B leaves 30 ms: 30 tokens
    assert p.budget(now, [(now - 0.6, 10), (now - 0.245, 3)]) == p.min_tokens  # B: 5 ms, under the floor
    assert p.budget(now, [(now - 0.1, 3)]) == int((0.2 - 0.05) / 0.001)


def test_a_stream_that_would_miss_the_target_anyway_constrains_no_one():
    p = _measured()
    now = 100.0
    # B: 3 tokens over 0.27 s: 30 ms of slack, less than one 50 ms decode step: lost either way.
    assert p.budget(now, [(now - 0.6, 10), (now - 0.27, 3)]) == p.budget(now, [(now - 0.6, 10)])
    assert p.budget(now, [(now - 0.27, 3)]) is None  # nobody left to protect: no cap


def test_no_cap_without_streams_or_before_a_per_token_rate_is_measured():
    assert _measured().budget(1.0, []) is None
    fresh = PrefillPacer(0.1)
    assert fresh.budget(1.0, [(0.9, 2)]) is None
    fresh.observe(2, 0, 0.05)
    assert fresh.budget(1.0, [(0.9, 2)]) is None


def test_without_a_decode_only_step_mixed_steps_are_charged_to_their_prompt_tokens():
    p = PrefillPacer(0.1)
    p.observe(4, 100, 1.05)  # 50 ms of decodes inside, unknown: 10.5 ms per token, not 10
    assert p.prefill_s_per_token == pytest.approx(0.0105)
    assert p.budget(10.0, [(9.5, 10)]) == int(0.5 / 0.0105)  # no decode part subtracted either
    assert p.budget(10.0, [(9.5, 5)]) == p.min_tokens  # no slack left, but no decode time known: kept


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan])
def test_a_target_must_be_positive(bad):
    with pytest.raises(ValueError, match="tpot_slo_s"):
        PrefillPacer(bad)
    with pytest.raises(ConfigError, match="tpot_slo_ms"):
        EngineConfig(tpot_slo_ms=bad if bad != 0.0 else -0.5).validate()


def _req(rid: str, n: int, seq: int, base: int) -> Request:
    return Request(rid, [base + i for i in range(n)], SamplingParams(max_tokens=100),
                   RequestMetrics(arrival_time=float(seq)), arrival_seq=seq)


def _step(s: Scheduler, now: float | None) -> list[int]:
    out = s.schedule(now)
    s.update_after_step(out)
    for seq in out.seqs:
        if seq.produces_token:
            seq.request.append_token(7)
            seq.request.metrics.first_token_time = seq.request.metrics.first_token_time or now or 0.0
    s.kv.check_integrity()
    return [x.num_new_tokens for x in out.seqs]


def test_the_scheduler_cuts_a_prompt_beside_decodes_to_the_pacers_allowance():
    kv = KVCacheManager(256, BS, True, extra_key("m", "float32"))
    pacer = _measured(slo_s=0.1, decode_s=0.05, per_token_s=0.01)  # 10 ms per prompt token
    s = Scheduler(kv, 8, 64, pacer=pacer)
    a = _req("a", 8, 0, base=10)
    s.add(a)
    assert _step(s, 1.0) == [8]  # nothing decodes yet: no cap; a's first token at t = 1.0
    b = _req("b", 200, 1, base=500)
    s.add(b)
    # a: 1 token, 30 ms after it: slack 70 ms, less the 50 ms decode step: nothing -> the floor.
    assert _step(s, 1.03) == [1, pacer.min_tokens]
    # a: 2 tokens, 40 ms after the first: slack 0.16 s -> (0.16 - 0.05) / 0.01 = 11 -> the floor.
    assert _step(s, 1.04) == [1, pacer.min_tokens]
    # a: 3 tokens at 1.05: slack 0.25 s -> 20 tokens.
    assert _step(s, 1.05) == [1, 20]
    # Without a clock the same state gets the whole remaining budget.
    assert _step(s, None) == [1, 63]
    # The allowance is shared: b (running, first) takes it all and c, waiting, is not admitted.
    c = _req("c", 100, 2, base=900)
    s.add(c)
    allowance = pacer.budget(1.1, [(1.0, 5)])  # a: 5 tokens 0.1 s after its first: (0.4 - 0.05) / 0.01
    assert 34 <= allowance <= 35 and _step(s, 1.1) == [1, allowance]
    assert c.num_computed_tokens == 0 and s.num_waiting == 1


def test_pacing_is_off_without_chunked_prefill():
    kv = KVCacheManager(64, BS, True, extra_key("m", "float32"))
    assert Scheduler(kv, 8, 64, enable_chunked_prefill=False, pacer=_measured()).pacer is None
