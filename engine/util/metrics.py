"""Prometheus helpers every kvmesh role shares (engine server, router, cache node).

Rules they enforce:
- each app owns its own `CollectorRegistry` (no process-global registry, so
  two apps in one process or one test never see each other's series);
- latency histograms are in seconds, with the bucket sets below so dashboards
  and autoscaler queries line up across roles;
- values that another component already keeps (engine counters, pool sizes)
  are read at scrape time by a `CallbackCollector` instead of being copied
  into mutable metrics on every change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

PREFIX = "kvmesh_"

# Request-level latencies (TTFT, end-to-end, queue time): milliseconds to minutes.
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0,
    5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)
# Per-token latencies (inter-token latency, time per output token).
TOKEN_LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)
# The router's end-to-end latencies (engine/router/slo.py), with the engines' TTFT/TPOT buckets.
# Named here because the operator's autoscaler and dashboard read them too.
ROUTER_TTFT = "kvmesh_router_time_to_first_token_seconds"
ROUTER_TPOT = "kvmesh_router_time_per_output_token_seconds"
STREAM_LABEL = "stream"  # of ROUTER_TTFT: "true" (first token event of a stream) or "false" (whole body)
# Event-loop responsiveness (how long ready work waits for the loop): sub-millisecond upward.
EVENT_LOOP_LAG_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
)


class MetricNameError(ValueError):
    """A kvmesh metric name does not follow the naming rule."""


def check_name(name: str) -> str:
    if not name.startswith(PREFIX):
        raise MetricNameError(f"kvmesh metric names start with {PREFIX!r}: {name!r}")
    return name


def new_registry() -> CollectorRegistry:
    """A fresh registry without the process/platform collectors (one per app)."""
    return CollectorRegistry(auto_describe=True)


def histogram(registry: CollectorRegistry, name: str, doc: str, buckets: Sequence[float],
              labelnames: Sequence[str] = ()) -> Histogram:
    if not name.endswith("_seconds"):
        raise MetricNameError(f"latency histograms are in seconds and end in '_seconds': {name!r}")
    return Histogram(check_name(name), doc, labelnames=labelnames, buckets=buckets, registry=registry)


def counter(registry: CollectorRegistry, name: str, doc: str, labelnames: Sequence[str] = ()) -> Counter:
    # prometheus_client appends "_total" itself.
    return Counter(check_name(name.removesuffix("_total")), doc, labelnames=labelnames, registry=registry)


def gauge(registry: CollectorRegistry, name: str, doc: str, labelnames: Sequence[str] = ()) -> Gauge:
    return Gauge(check_name(name), doc, labelnames=labelnames, registry=registry)


class CallbackCollector(Collector):
    """Yields the metric families `fn` builds at each scrape.

    `describe` returns nothing so that registering does not call `fn` (the
    source may not exist yet); `fn` must be cheap and must not block.
    """

    def __init__(self, fn: Callable[[], Iterable[Metric]]) -> None:
        self._fn = fn

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        return list(self._fn())


def gauge_family(name: str, doc: str, value: float, labels: Mapping[str, str] | None = None) -> GaugeMetricFamily:
    labels = dict(labels or {})
    fam = GaugeMetricFamily(name, doc, labels=list(labels))
    fam.add_metric(list(labels.values()), float(value))
    return fam


def counter_family(name: str, doc: str, value: float, labels: Mapping[str, str] | None = None) -> CounterMetricFamily:
    labels = dict(labels or {})
    fam = CounterMetricFamily(name.removesuffix("_total"), doc, labels=list(labels))
    fam.add_metric(list(labels.values()), float(value))
    return fam


def render(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The registry in the Prometheus text format, with its content type."""
    return generate_latest(registry), CONTENT_TYPE_LATEST


def parse_samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of a text exposition keyed by (sample name, label set).

    For scrapers that read a few values directly (tests, the autoscaler's
    no-Prometheus metric source).
    """
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def sample_value(samples: Mapping[tuple[str, frozenset[tuple[str, str]]], float], name: str,
                 **labels: str) -> float | None:
    """The value of the one sample `name` whose labels include `labels` (None if absent).

    Raises ValueError when several samples match, so a caller never reads an
    arbitrary one of them.
    """
    want = set(labels.items())
    hits = [v for (n, ls), v in samples.items() if n == name and want <= ls]
    if len(hits) > 1:
        raise ValueError(f"{len(hits)} samples named {name!r} match {labels}; add labels to pick one")
    return hits[0] if hits else None
