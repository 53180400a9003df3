"""Pure parts of the serving benchmark (bench/serving.py, bench/loadtool.py)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))

import loadtool  # noqa: E402
import serving  # noqa: E402

from tests.support.fake_step_engine import FakeTokenizer  # noqa: E402


def test_percentile_interpolates():
    assert serving.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert serving.percentile([0.0, 10.0], 90) == pytest.approx(9.0)
    assert serving.percentile([5.0], 99) == 5.0


def test_poisson_arrivals_are_increasing_with_the_requested_mean_rate():
    times = serving.poisson_arrivals(4.0, 4000, random.Random(1))
    assert all(b > a for a, b in zip(times, times[1:]))
    assert 4000 / times[-1] == pytest.approx(4.0, rel=0.05)
    assert times == serving.poisson_arrivals(4.0, 4000, random.Random(1))


@pytest.mark.parametrize("n", [8, 50, 128])
def test_prompts_have_exactly_the_requested_token_count(n):
    tok = FakeTokenizer()
    rng = random.Random(0)
    for _ in range(5):
        assert len(tok.encode(serving.make_prompt(tok, rng, n))) == n


def test_guidellm_report_summary():
    def dist(mean, p50, p90, p99):
        return {"successful": {"mean": mean, "count": 4, "percentiles": {"p50": p50, "p90": p90, "p99": p99}}}

    report = {"benchmarks": [{"duration": 10.0, "metrics": {
        "time_to_first_token_ms": dist(200, 190, 250, 300), "inter_token_latency_ms": dist(50, 48, 60, 70),
        "time_per_output_token_ms": dist(55, 52, 66, 77), "request_latency": dist(3.0, 2.9, 3.5, 4.0),
        "prompt_token_count": {"successful": {"mean": 158.0}}, "request_totals": {"successful": 4},
        "output_token_count": {"successful": {"mean": 64.0, "count": 4}}}}]}
    s = loadtool.summarize_guidellm(report)
    assert s["ttft_s"]["p50"] == pytest.approx(0.19) and s["tpot_s"]["p99"] == pytest.approx(0.07)
    assert s["output_tok_s"] == pytest.approx(25.6) and s["request_throughput"] == pytest.approx(0.4)
    assert s["prompt_tokens_mean"] == 158.0


def test_the_fleet_gives_vllm_kvmeshs_kv_budget():
    """bench/fleet.py: whole GiB through the issue's VLLM_CPU_KVCACHE_SPACE, anything else through
    --kv-cache-memory-bytes with the variable removed (vLLM would let it override the flag)."""
    import fleet

    env = {"VLLM_CPU_KVCACHE_SPACE": "4"}
    assert fleet.vllm_kv_budget(1 << 30, env) == [] and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert fleet.vllm_kv_budget(128 << 20, env) == ["--kv-cache-memory-bytes", str(128 << 20)]
    assert "VLLM_CPU_KVCACHE_SPACE" not in env
