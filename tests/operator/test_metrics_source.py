"""The metric sources' arithmetic without Prometheus or engines (the real ones:
test_metrics_sources_prometheus.py)."""

import math

import pytest

from kvmesh.operator.metrics_source import (
    ENGINES,
    ROUTER,
    Hist,
    MetricsSourceError,
    PodScrapeSource,
    PoolTarget,
    PrometheusSource,
    bucket_quantile,
    latency_histograms,
)


def test_bucket_quantile_interpolates_like_histogram_quantile():
    b = {0.1: 10.0, 0.2: 30.0, math.inf: 40.0}
    assert bucket_quantile(0.5, b) == pytest.approx(0.15)  # rank 20: halfway through (0.1, 0.2]
    assert bucket_quantile(0.2, b) == pytest.approx(0.08)  # rank 8 in [0, 0.1]
    assert bucket_quantile(0.95, b) == 0.2  # rank in +Inf: the highest finite bound
    assert bucket_quantile(0.5, {0.1: 0.0, math.inf: 0.0}) is None
    assert bucket_quantile(0.5, {}) is None


def exposition(ttft_counts, kv, queued, les=(0.1, 0.5, 1.0)):
    lines = []
    for le, c in zip((*les, "+Inf"), ttft_counts):
        lines.append(f'kvmesh_time_to_first_token_seconds_bucket{{le="{le}",model_name="m"}} {c}')
    lines += [f'kvmesh_time_to_first_token_seconds_count{{model_name="m"}} {ttft_counts[-1]}',
              f'kvmesh_kv_cache_usage_ratio{{model_name="m",tier="gpu"}} {kv}',
              f'kvmesh_queued_prefill_tokens{{model_name="m"}} {queued}']
    return "\n".join(lines) + "\n"


class FakePods:
    def __init__(self):
        self.pages = {}

    def fetch(self, url):
        page = self.pages.get(url)
        if page is None:
            raise MetricsSourceError(f"GET {url}: connection refused")
        return page


def test_pod_scrape_quantile_from_windowed_deltas_summed_over_pods():
    pods = FakePods()
    src = PodScrapeSource(fetch=pods.fetch)
    target = PoolTarget("ns", "llm", "decode", ("a:1", "b:1"), window_s=60, percentile=50)
    # Old traffic (before the window) was all slow: it must not count.
    pods.pages = {"http://a:1/metrics": exposition([0, 0, 100, 100], 0.2, 10),
                  "http://b:1/metrics": exposition([0, 0, 0, 0], 0.4, 0)}
    first = src.sample(target, now=0.0)
    assert first.pods == 2 and first.ttft_s is None  # one scrape: no rate yet
    assert first.kv_occupancy == pytest.approx(0.3) and first.queued_prefill_tokens == 10
    pods.pages = {"http://a:1/metrics": exposition([10, 10, 110, 110], 0.6, 0),
                  "http://b:1/metrics": exposition([10, 30, 30, 30], 0.8, 5)}
    s = src.sample(target, now=30.0)
    # window deltas: (0.1]: 20, (0.5]: 40, (1.0]: 40 -> rank 20 of 40 at the first bound
    assert s.ttft_s == pytest.approx(0.1)
    assert s.kv_occupancy == pytest.approx(0.7) and s.queued_prefill_tokens == 5


def test_pod_scrape_survives_a_missing_pod_and_a_restarted_one():
    pods = FakePods()
    src = PodScrapeSource(fetch=pods.fetch)
    target = PoolTarget("ns", "llm", "prefill", ("a:1", "gone:1"), window_s=60, percentile=50)
    pods.pages = {"http://a:1/metrics": exposition([50, 50, 50, 50], 0.1, 0)}
    assert src.sample(target, now=0.0).pods == 1
    # Counters went down: the pod restarted, its counts since the restart are the delta.
    pods.pages = {"http://a:1/metrics": exposition([0, 4, 4, 4], 0.1, 0)}
    s = src.sample(target, now=10.0)
    assert s.pods == 1 and 0.1 < s.ttft_s <= 0.5


def test_prometheus_source_names_the_endpoint_when_unreachable():
    src = PrometheusSource("http://127.0.0.1:9", timeout_s=2)
    with pytest.raises(MetricsSourceError, match="127.0.0.1:9/api/v1/query"):
        src.sample(PoolTarget("ns", "llm", "decode"), now=1.0)


# ---- disaggregated: latency from the router's end-to-end histograms ------------------------
ROUTER_TTFT = "kvmesh_router_time_to_first_token_seconds"
ROUTER_TPOT = "kvmesh_router_time_per_output_token_seconds"


def hist_lines(name, counts, labels="", les=(0.1, 0.5, 1.0)):
    sep = "," if labels else ""
    return [f'{name}_bucket{{{labels}{sep}le="{le}"}} {c}' for le, c in zip((*les, "+Inf"), counts)]


def engine_page(ttft, tpot):
    lines = hist_lines("kvmesh_time_to_first_token_seconds", ttft, 'model_name="m"')
    lines += hist_lines("kvmesh_time_per_output_token_seconds", tpot, 'model_name="m"', les=(0.01, 0.05, 0.1))
    lines += ['kvmesh_kv_cache_usage_ratio{model_name="m",tier="gpu"} 0.5']
    return "\n".join(lines) + "\n"


def router_page(streamed, whole, tpot):
    lines = hist_lines(ROUTER_TTFT, streamed, 'stream="true"') + hist_lines(ROUTER_TTFT, whole, 'stream="false"')
    lines += hist_lines(ROUTER_TPOT, tpot, les=(0.01, 0.05, 0.1))
    return "\n".join(lines) + "\n"


def test_latency_histograms_per_pool_kind():
    engines_ttft = Hist(ENGINES, "kvmesh_time_to_first_token_seconds")
    engines_tpot = Hist(ENGINES, "kvmesh_time_per_output_token_seconds")
    router_ttft = Hist(ROUTER, ROUTER_TTFT, (("stream", "true"),))
    router_tpot = Hist(ROUTER, ROUTER_TPOT)
    colocated = latency_histograms(PoolTarget("ns", "llm", "decode"))
    assert colocated == {"ttft": (engines_ttft,), "tpot": (engines_tpot,)}
    prefill = latency_histograms(PoolTarget("ns", "llm", "prefill", disaggregated=True))
    assert prefill["ttft"] == (router_ttft, engines_ttft)
    decode = latency_histograms(PoolTarget("ns", "llm", "decode", disaggregated=True))
    # A decode engine's TTFT starts at stage 2: never a stand-in.
    assert decode == {"ttft": (router_ttft,), "tpot": (router_tpot, engines_tpot)}


def pd_targets(routers=("r:1",)):
    return [PoolTarget("ns", "llm", "prefill", ("p:1",), 60, 50, disaggregated=True, routers=routers),
            PoolTarget("ns", "llm", "decode", ("d:1",), 60, 50, disaggregated=True, routers=routers)]


def test_pod_scrape_reads_the_routers_end_to_end_series_for_a_disaggregated_deployment():
    zero = [0, 0, 0, 0]
    pages = {"http://p:1/metrics": engine_page(zero, zero), "http://d:1/metrics": engine_page(zero, zero),
             "http://r:1/metrics": router_page(zero, zero, zero)}
    src_fetched = []

    def fetch(url):
        src_fetched.append(url)
        return pages[url]

    src = PodScrapeSource(fetch=fetch)
    prefill, decode = pd_targets()
    src.sample(prefill, 0.0)
    src.sample(decode, 0.0)
    # In the window: prefill engines' TTFT all <= 0.1, decode engines' TTFT all <= 0.1 (stage 2),
    # the router's streamed TTFT all in (0.5, 1.0], its non-streamed (whole bodies) past 1.0;
    # decode engines' TPOT <= 0.01, the router's in (0.05, 0.1].
    pages = {"http://p:1/metrics": engine_page([10, 10, 10, 10], zero),
             "http://d:1/metrics": engine_page([10, 10, 10, 10], [10, 10, 10, 10]),
             "http://r:1/metrics": router_page([0, 0, 10, 10], [0, 0, 0, 50], [0, 0, 10, 10])}
    p, d = src.sample(prefill, 30.0), src.sample(decode, 30.0)
    assert 0.5 < p.ttft_s <= 1.0 and p.ttft_from == "router"
    assert 0.05 < d.tpot_s <= 0.1 and d.tpot_from == "router"
    assert 0.5 < d.ttft_s <= 1.0 and d.ttft_from == "router"
    assert p.pods == d.pods == 1  # the router is no pod of either pool
    assert src_fetched.count("http://r:1/metrics") == 2  # once per tick, whichever pools ask


def test_pod_scrape_falls_back_to_the_pools_engines_while_the_router_has_nothing():
    zero = [0, 0, 0, 0]
    pages = {"http://p:1/metrics": engine_page(zero, zero), "http://d:1/metrics": engine_page(zero, zero),
             "http://r:1/metrics": router_page(zero, zero, zero)}
    src = PodScrapeSource(fetch=lambda url: pages[url])
    prefill, decode = pd_targets()
    src.sample(prefill, 0.0), src.sample(decode, 0.0)
    # Only non-streamed requests: the router's streamed TTFT and its TPOT saw nothing.
    pages = {"http://p:1/metrics": engine_page([10, 10, 10, 10], zero),
             "http://d:1/metrics": engine_page([10, 10, 10, 10], [10, 10, 10, 10]),
             "http://r:1/metrics": router_page(zero, [0, 0, 0, 50], zero)}
    p, d = src.sample(prefill, 30.0), src.sample(decode, 30.0)
    assert p.ttft_s <= 0.1 and p.ttft_from == "engines"
    assert d.tpot_s <= 0.01 and d.tpot_from == "engines"
    assert d.ttft_s is None  # never the decode engines' stage-2 TTFT
    # No router pod ready at all: the same stand-in.
    bare = PodScrapeSource(fetch=lambda url: pages[url])
    lone = pd_targets(routers=())[0]
    pages["http://p:1/metrics"] = engine_page(zero, zero)
    bare.sample(lone, 0.0)
    pages["http://p:1/metrics"] = engine_page([10, 10, 10, 10], zero)
    p2 = bare.sample(lone, 30.0)
    assert p2.ttft_s <= 0.1 and p2.ttft_from == "engines" and p2.pods == 1


class RecordingPrometheus(PrometheusSource):
    """Answers from `answers` (a substring of the query -> value), recording every query."""

    def __init__(self, answers):
        super().__init__("http://prometheus.invalid")
        self.answers, self.queries = answers, []

    def scalar(self, promql, now):
        self.queries.append(promql)
        return next((v for key, v in self.answers.items() if key in promql), None)


def test_prometheus_source_queries_the_routers_pods_for_a_disaggregated_deployment():
    src = RecordingPrometheus({ROUTER_TTFT: 0.8, ROUTER_TPOT: 0.07, "count(": 2})
    p = src.sample(PoolTarget("ns", "llm", "prefill", window_s=60, percentile=90, disaggregated=True), 5.0)
    assert (p.ttft_s, p.ttft_from, p.tpot_s, p.tpot_from, p.pods) == (0.8, "router", 0.07, "router", 2)
    (ttft_q,) = [q for q in src.queries if ROUTER_TTFT in q]
    assert ttft_q == ('histogram_quantile(0.9, sum by (le) (rate(kvmesh_router_time_to_first_token_seconds_bucket'
                      '{namespace="ns",pod=~"llm-router-[a-z0-9]+-[a-z0-9]+",stream="true"}[60s])))')
    assert not any("kvmesh_time_to_first_token_seconds" in q for q in src.queries)  # not needed
    # The router saw nothing yet: the pool's engines stand in, except a decode engine's TTFT.
    src = RecordingPrometheus({"kvmesh_time_to_first_token_seconds": 0.01,
                               "kvmesh_time_per_output_token_seconds": 0.02})
    d = src.sample(PoolTarget("ns", "llm", "decode", disaggregated=True), 5.0)
    assert (d.ttft_s, d.tpot_s, d.tpot_from) == (None, 0.02, "engines")
    assert any('pod=~"llm-decode-' in q and "kvmesh_time_per_output_token_seconds" in q for q in src.queries)


def test_prometheus_source_keeps_the_engines_series_for_a_colocated_deployment():
    src = RecordingPrometheus({"kvmesh_time_to_first_token_seconds": 0.3})
    s = src.sample(PoolTarget("ns", "llm", "decode"), 5.0)
    assert s.ttft_s == 0.3 and s.ttft_from == "engines"
    assert not any("kvmesh_router_" in q for q in src.queries)
