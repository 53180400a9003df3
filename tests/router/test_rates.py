"""The router's measured engine rates (engine/router/rates.py) and where they come from: the
prefill clock the dispatcher drives, the scrape's inter-token latency, and the proxy's
first-token hook that ends a request's prefill. All driven with explicit times, no clocks."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.engine.router import proxy
from kvmesh.engine.router.discovery import EngineReport, EngineState, engine_report_from_metrics
from kvmesh.engine.router.rates import (
    MIN_PREFILL_TOKENS,
    PREFILL_DECAY,
    PrefillClock,
    RateEstimate,
    decode_seconds_per_seq,
    interval_median,
)


def test_rate_estimate_needs_enough_units_then_is_the_decayed_ratio():
    r = RateEstimate().observe(100, 0.5, decay=0.5)
    assert r.seconds_per_unit(min_units=200) is None
    r = r.observe(400, 1.0, decay=0.5)  # units 50 + 400, seconds 0.25 + 1.0
    assert r.units == pytest.approx(450) and r.seconds == pytest.approx(1.25)
    assert r.seconds_per_unit(min_units=200) == pytest.approx(1.25 / 450)
    # Old observations fade: a now much slower engine dominates after a few requests.
    for _ in range(30):
        r = r.observe(100, 1.0, decay=0.5)
    assert r.seconds_per_unit(min_units=1) == pytest.approx(0.01, rel=1e-3)
    assert RateEstimate().observe(-5, -1).units == 0 and RateEstimate(10, 0).seconds_per_unit(1) is None


def test_prefill_clock_charges_busy_time_to_the_tokens_drained():
    c = PrefillClock()
    c.queued(0, now=10.0)  # a 600-token request on an idle engine
    c.queued(600, now=10.5)  # a 400-token one behind it: the clock keeps running
    c.drained(600, tokens_left=400, now=11.2)  # 1.2 s for the first
    assert c.busy_since == 11.2
    c.drained(400, tokens_left=0, now=12.0)  # 0.8 s more for the second
    assert c.busy_since is None
    # Decayed sums: d * 600 + 400 tokens over d * 1.2 + 0.8 s.
    d = PREFILL_DECAY
    units, seconds = d * 600 + 400, d * 1.2 + 0.8
    assert c.estimate.units == pytest.approx(units) and c.estimate.seconds == pytest.approx(seconds)
    assert c.seconds_per_token() == pytest.approx(seconds / units)
    # Idle time between busy periods is never charged.
    c.queued(0, now=100.0)
    c.drained(100, tokens_left=0, now=100.2)
    assert c.estimate.seconds == pytest.approx(d * seconds + 0.2)


def test_prefill_clock_does_not_time_failures_and_stops_when_the_queue_empties():
    c = PrefillClock()
    c.queued(0, now=0.0)
    c.drained(500, tokens_left=0, now=3.0, measured=False)  # the engine failed: no sample
    assert c.estimate == RateEstimate() and c.busy_since is None
    c.drained(500, tokens_left=0, now=4.0)  # not busy: nothing to charge
    assert c.estimate == RateEstimate()
    assert c.seconds_per_token() is None and MIN_PREFILL_TOKENS > 0


INF = float("inf")


def test_interval_median_reads_what_happened_between_two_scrapes():
    before = ((0.01, 10.0), (0.02, 10.0), (0.05, 10.0), (INF, 10.0))
    # 8 steps of 10-20 ms and 2 stalls of a long prefill (> 50 ms): the median ignores the stalls.
    after = ((0.01, 10.0), (0.02, 18.0), (0.05, 18.0), (INF, 20.0))
    assert interval_median(before, after) == pytest.approx(0.01 + 0.01 * (5 / 8))
    assert interval_median(before, before) is None  # nothing observed
    assert interval_median(None, after) is None  # the first scrape
    assert interval_median(after, before) is None  # counts went back: a restarted engine
    assert interval_median(before[:3], after) is None  # other buckets
    assert interval_median(((0.01, 0.0), (INF, 0.0)), ((0.01, 0.0), (INF, 4.0))) == 0.01  # past the last bound
    assert interval_median(((0.01, 0.0), (INF, 0.0)), ((0.01, 4.0), (INF, 4.0))) == pytest.approx(0.005)


def test_decode_seconds_per_seq_is_the_step_time_shared_by_the_batch():
    assert decode_seconds_per_seq(0.04, running=4) == pytest.approx(0.01)
    assert decode_seconds_per_seq(0.04, running=0) == pytest.approx(0.04)  # a batch of one
    assert decode_seconds_per_seq(None, running=3) is None


def test_scrape_reads_the_inter_token_histogram_and_the_running_batch():
    text = ('kvmesh_num_requests_running{model_name="m"} 4.0\n'
            'kvmesh_num_requests_waiting{model_name="m"} 1.0\n'
            'kvmesh_inter_token_latency_seconds_bucket{le="0.02",model_name="m"} 10.0\n'
            'kvmesh_inter_token_latency_seconds_bucket{le="+Inf",model_name="m"} 10.0\n'
            'kvmesh_inter_token_latency_seconds_bucket{le="0.01",model_name="m"} 10.0\n'
            'kvmesh_inter_token_latency_seconds_sum{model_name="m"} 2.5\n'
            'kvmesh_inter_token_latency_seconds_count{model_name="m"} 10.0\n')
    r = engine_report_from_metrics(text)
    assert (r.load, r.running) == (5, 4)
    assert r.itl_buckets == ((0.01, 10.0), (0.02, 10.0), (INF, 10.0))
    assert engine_report_from_metrics("").itl_buckets is None

    st = EngineState("u")
    st.observe_report(r)  # the first scrape only sets the baseline
    assert st.decode_s_per_seq is None and st.reported_load == 5
    # 10 more tokens, all 10-20 ms apart: median 15 ms, shared by 4 running sequences.
    st.observe_report(EngineReport(load=5, running=4, itl_buckets=((0.01, 10.0), (0.02, 20.0), (INF, 20.0))))
    assert st.decode_s_per_seq == pytest.approx(0.015 / 4)
    restarted = ((0.01, 1.0), (0.02, 1.0), (INF, 1.0))
    st.observe_report(EngineReport(load=0, running=0, itl_buckets=restarted))
    assert st.decode_s_per_seq == pytest.approx(0.015 / 4) and st.itl_seen == restarted
    ep = st.endpoint()
    assert ep.decode_s_per_seq == pytest.approx(0.015 / 4) and ep.prefill_s_per_token is None


class _Content:
    def __init__(self, chunks):
        self._chunks = list(chunks)

    async def readany(self):
        return self._chunks.pop(0) if self._chunks else b""

    async def iter_any(self):
        while self._chunks:
            yield self._chunks.pop(0)


class _Resp:
    status = 200
    headers = {"content-type": "text/event-stream"}

    def __init__(self, chunks):
        self.content = _Content(chunks)


def _relay(chunks):
    events: list[str] = []
    sent: list[dict] = []

    async def send(msg):
        sent.append(msg)
        if msg["type"] == "http.response.body" and msg.get("body"):
            events.append("sent")

    hooks = proxy.Hooks(first_byte=lambda s: events.append("byte"), engine_failed=lambda why: None,
                        first_token=lambda: events.append("token"))
    done = asyncio.run(proxy._relay_stream(_Resp(chunks), send, hooks, 0.0))
    return done, events


ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
TOKEN = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
DONE = b"data: [DONE]\n\n"


def test_the_prefill_ends_at_the_first_token_event_not_the_role_only_first_byte():
    done, events = _relay([ROLE, TOKEN, TOKEN, DONE])
    assert isinstance(done, proxy.Done)
    # byte at the role chunk (the response head goes out), token only with the first token chunk
    assert events == ["byte", "sent", "token", "sent", "sent", "sent"]
    _, events = _relay([ROLE + TOKEN, TOKEN, DONE])  # both in one chunk: at once
    assert events[:3] == ["byte", "token", "sent"]
    _, events = _relay([ROLE, DONE])  # no token at all: never
    assert "token" not in events


def test_the_router_exposes_the_rates_it_scores_with():
    from kvmesh.engine.router.metrics import RouterMetrics
    from kvmesh.engine.util.metrics import parse_samples, render, sample_value

    m = RouterMetrics("cache-aware", lambda: 2, dict, dict,
                      rates=lambda: {"http://a": (0.003, 0.012), "http://b": (None, None)})
    s = parse_samples(render(m.registry)[0].decode())
    assert sample_value(s, "kvmesh_router_engine_prefill_seconds_per_token", engine="http://a") == 0.003
    assert sample_value(s, "kvmesh_router_engine_decode_seconds_per_sequence", engine="http://a") == 0.012
    assert sample_value(s, "kvmesh_router_engine_prefill_seconds_per_token", engine="http://b") is None
