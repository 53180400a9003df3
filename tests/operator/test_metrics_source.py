"""The metric sources' arithmetic without Prometheus or engines (the real ones:
test_metrics_sources_prometheus.py)."""

import math

import pytest

from kvmesh.operator.metrics_source import (
    MetricsSourceError,
    PodScrapeSource,
    PoolTarget,
    PrometheusSource,
    bucket_quantile,
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
