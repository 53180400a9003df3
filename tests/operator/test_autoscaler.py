"""The autoscaling decision over synthetic metric windows (no I/O, no clock)."""

from dataclasses import replace

import pytest

from kvmesh.operator.autoscaler import (
    AutoscalerState,
    MetricsWindow,
    Policy,
    PoolSample,
    bounds,
    decide,
    recommend,
)
from kvmesh.operator.spec import parse_spec


def make_spec(prefill=None, decode=None, up=30, down=300, window=60, enabled=True, slo=None):
    return parse_spec({
        "model": {"name": "m"},
        "prefill": prefill or {"replicas": 1, "minReplicas": 1, "maxReplicas": 4},
        "decode": decode or {"replicas": 2, "minReplicas": 1, "maxReplicas": 8},
        "slo": slo or {"ttftMs": 500, "tpotMs": 50, "percentile": 95},
        "autoscaling": {"enabled": enabled, "kvOccupancyTarget": 0.8,
                        "scaleUpStabilizationSeconds": up,
                        "scaleDownStabilizationSeconds": down,
                        "metricsWindowSeconds": window},
    })


def sample(t, pods=2, kv=0.5, tpot=0.02, ttft=0.1, queued=0.0):
    return PoolSample(t=t, pods=pods, kv_occupancy=kv, tpot_s=tpot, ttft_s=ttft,
                      queued_prefill_tokens=queued)


def run(spec, per_pool, times, replicas, state=None):
    """Call decide at each time in `times`; `per_pool(component, t)` gives that pool's
    sample at t (or None). Returns the decisions of each call and the final state."""
    state = state or AutoscalerState(replicas=dict(replicas))
    samples: dict[str, list] = {}
    out = []
    for t in times:
        for c in ("prefill", "decode"):
            x = per_pool(c, t)
            if x is not None:
                samples.setdefault(c, []).append(x)
        window = MetricsWindow({c: tuple(v) for c, v in samples.items()})
        decisions, state = decide(spec, window, state, float(t))
        out.append(decisions)
    return out, state


def test_kv_occupancy_above_target_scales_decode_up_after_the_up_window():
    spec = make_spec()
    hot = lambda c, t: sample(t, pods=2, kv=0.96) if c == "decode" else sample(t, pods=1)
    out, state = run(spec, hot, range(0, 31, 5), {"prefill": 1, "decode": 2})
    assert [d["decode"].desired for d in out[:-1]] == [2] * 6
    assert out[0]["decode"].reason == "ScaleUpStabilizing"
    last = out[-1]["decode"]
    # mean occupancy 0.96 / 0.8 = 1.2 -> ceil(2 * 1.2) = 3
    assert (last.current, last.desired, last.reason) == (2, 3, "KVOccupancyHigh")
    assert "KV occupancy 0.96 / target 0.80" in last.message
    assert state.replicas["decode"] == 3
    assert out[-1]["prefill"].desired == 1


def test_tpot_over_slo_scales_decode_up_even_with_low_occupancy():
    spec = make_spec(up=0)
    slow = lambda c, t: sample(t, pods=2, kv=0.3, tpot=0.080) if c == "decode" else None
    out, _ = run(spec, slow, [0], {"prefill": 1, "decode": 2})
    d = out[0]["decode"]
    # TPOT 80 ms / 50 ms = 1.6 -> ceil(2 * 1.6) = 4
    assert (d.desired, d.reason, d.slo_met) == (4, "TPOTAboveSLO", False)


def test_prefill_scales_on_ttft_and_on_queued_prefill_tokens():
    spec = make_spec(up=0)
    ttft = lambda c, t: sample(t, pods=1, ttft=0.9) if c == "prefill" else None
    d = run(spec, ttft, [0], {"prefill": 1, "decode": 2})[0][0]["prefill"]
    assert (d.desired, d.reason) == (2, "TTFTAboveSLO")
    queue = lambda c, t: sample(t, pods=2, queued=3 * 2 * 2048.0) if c == "prefill" else None
    d = run(spec, queue, [0], {"prefill": 2, "decode": 2})[0][0]["prefill"]
    # 6144 tokens per replica / 2048 = 3 -> ceil(2 * 3) = 6, capped at doubling (4) and max 4
    assert (d.desired, d.reason) == (4, "PrefillQueueHigh")


def test_scale_up_is_bounded_by_max_replicas():
    spec = make_spec(up=0, decode={"replicas": 3, "minReplicas": 1, "maxReplicas": 3})
    hot = lambda c, t: sample(t, pods=3, kv=1.0) if c == "decode" else None
    d = run(spec, hot, [0], {"prefill": 1, "decode": 3})[0][0]["decode"]
    assert (d.desired, d.reason) == (3, "AtMaxReplicas")


def test_scale_down_waits_for_the_down_window_and_goes_one_pod_at_a_time():
    spec = make_spec(down=120, decode={"replicas": 4, "minReplicas": 1, "maxReplicas": 8})
    idle = lambda c, t: sample(t, pods=4, kv=0.1, tpot=0.01) if c == "decode" else None
    out, state = run(spec, idle, range(0, 121, 10), {"prefill": 1, "decode": 4})
    assert all(d["decode"].desired == 4 for d in out[:-1])
    assert out[0]["decode"].reason == "ScaleDownStabilizing"
    last = out[-1]["decode"]
    assert (last.current, last.desired, last.reason) == (4, 3, "UnderUtilized")
    # The next pass may go on (the window already asked for 1), one pod per step.
    idle3 = lambda c, t: sample(t, pods=3, kv=0.1, tpot=0.01) if c == "decode" else None
    out, state = run(spec, idle3, [130], {}, state=state)
    assert out[0]["decode"].desired == 2


def test_no_scale_down_while_the_slo_is_missed_or_pods_are_missing():
    spec = make_spec(down=0, decode={"replicas": 4, "minReplicas": 1, "maxReplicas": 8})
    slow_idle = lambda c, t: sample(t, pods=4, kv=0.1, tpot=0.052) if c == "decode" else None
    d = run(spec, slow_idle, [0], {"prefill": 1, "decode": 4})[0][0]["decode"]
    assert (d.desired, d.slo_met) == (4, False)
    starting = lambda c, t: sample(t, pods=3, kv=0.1, tpot=0.01) if c == "decode" else None
    d = run(spec, starting, [0], {"prefill": 1, "decode": 4})[0][0]["decode"]
    assert d.desired == 4


def test_oscillating_load_never_flaps():
    """Occupancy swinging between 0.95 and 0.2 every 10 s for 20 minutes."""
    spec = make_spec(up=30, down=300, window=10)
    def swing(c, t):
        if c != "decode":
            return None
        return sample(t, pods=3, kv=0.95 if (t // 10) % 2 == 0 else 0.2, tpot=0.02)
    out, _ = run(spec, swing, range(0, 1200, 5), {"prefill": 1, "decode": 3})
    assert {d["decode"].desired for d in out} == {3}
    assert {d["decode"].reason for d in out} <= {"ScaleUpStabilizing", "ScaleDownStabilizing",
                                                  "WithinTarget"}


def test_sustained_then_released_load_goes_up_then_down():
    spec = make_spec(up=30, down=120, window=10)
    state = AutoscalerState(replicas={"prefill": 1, "decode": 2})
    seen = []

    def pool(c, t):
        if c != "decode":
            return None
        n = state.replicas["decode"]
        return sample(t, pods=n, kv=0.95 * 2 / n if t < 200 else 0.05, tpot=0.02)

    samples = []
    for t in range(0, 600, 5):
        samples.append(pool("decode", t))
        decisions, state = decide(spec, MetricsWindow({"decode": tuple(samples)}), state, float(t))
        seen.append(decisions["decode"].desired)
    assert max(seen) == 3 and seen[-1] == 1
    changes = [b for a, b in zip(seen, seen[1:]) if a != b]
    assert changes == [3, 2, 1]


def test_bounds_edited_under_a_running_pool_apply_at_once():
    spec = make_spec(decode={"replicas": 2, "minReplicas": 2, "maxReplicas": 5})
    none = lambda c, t: None
    d = run(spec, none, [0], {"prefill": 1, "decode": 7})[0][0]["decode"]
    assert (d.desired, d.reason) == (5, "AboveMaxReplicas")
    d = run(spec, none, [0], {"prefill": 1, "decode": 1})[0][0]["decode"]
    assert (d.desired, d.reason) == (2, "BelowMinReplicas")


def test_unset_bounds_are_the_replicas_and_prefill_never_goes_to_zero():
    spec = make_spec(prefill={"replicas": 2, "minReplicas": 0, "maxReplicas": 3},
                     decode={"replicas": 3})
    assert bounds(spec, "decode") == (3, 3)
    assert bounds(spec, "prefill") == (1, 3)


def test_colocated_pool_uses_every_signal():
    spec = make_spec(up=0, prefill={"replicas": 0})
    slow_ttft = lambda c, t: sample(t, pods=2, kv=0.3, ttft=1.0) if c == "decode" else None
    out, _ = run(spec, slow_ttft, [0], {"prefill": 0, "decode": 2})
    assert set(out[0]) == {"decode"}
    assert (out[0]["decode"].desired, out[0]["decode"].reason) == (4, "TTFTAboveSLO")


def test_no_metrics_holds_and_disabled_reports_slo_only():
    spec = make_spec()
    d = run(spec, lambda c, t: None, [0], {"prefill": 1, "decode": 2})[0][0]["decode"]
    assert (d.desired, d.reason, d.slo_met) == (2, "NoMetrics", None)
    off = make_spec(enabled=False, up=0)
    hot = lambda c, t: sample(t, pods=2, kv=1.0, tpot=0.2) if c == "decode" else None
    d = run(off, hot, [0], {"prefill": 1, "decode": 2})[0][0]["decode"]
    assert (d.desired, d.reason, d.slo_met) == (2, "AutoscalingDisabled", False)


@pytest.mark.parametrize("ratio,expected", [(1.05, 4), (1.3, 6), (5.0, 8), (0.5, 2), (0.85, 4)])
def test_recommend_tolerance_and_step_limits(ratio, expected):
    from kvmesh.operator.autoscaler import Signal
    got, _, _ = recommend(4, 4, [Signal("kv", ratio, False, "")], Policy())
    assert got == expected


def test_the_message_names_an_end_to_end_latency():
    spec = make_spec()
    pd = lambda c, t: replace(sample(t, pods=1, ttft=0.9), ttft_from="router") if c == "prefill" else \
        replace(sample(t, tpot=0.03), tpot_from="router")
    out, _ = run(spec, pd, [0], {"prefill": 1, "decode": 2})
    assert "TTFT end to end p95 900ms / SLO 500ms" in out[0]["prefill"].message
    assert "TPOT end to end p95 30ms / SLO 50ms" in out[0]["decode"].message
    plain, _ = run(spec, lambda c, t: sample(t), [0], {"prefill": 1, "decode": 2})
    assert "TTFT p95 100ms" in plain[0]["prefill"].message
