"""Where the autoscaler's numbers come from: Prometheus, or the pods themselves.

Both sources implement `MetricsSource.sample(target, now)` -> `PoolSample`
with the same meaning, so `autoscaler.decide` cannot tell them apart:

- `PrometheusSource` asks the Prometheus HTTP API: percentiles are
  `histogram_quantile(q, sum by (le) (rate(<hist>_bucket{sel}[W])))`, KV
  occupancy `avg(kvmesh_kv_cache_usage_ratio{sel, tier="gpu"})`, the prefill
  backlog `sum(kvmesh_queued_prefill_tokens{sel})`;
- `PodScrapeSource` GETs each pod's /metrics, keeps the scrapes of the last
  window per pod, and computes the same quantile from the per-`le` bucket
  deltas summed over the pods, with the interpolation `histogram_quantile`
  uses (`bucket_quantile`). Like `rate()`, it needs two scrapes of a pod in
  the window before that pod's latencies count, so the operator must scrape
  more often than once per window.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import httpx

from kvmesh.engine.util.metrics import parse_samples, sample_value

from .autoscaler import PoolSample

TTFT = "kvmesh_time_to_first_token_seconds"
TPOT = "kvmesh_time_per_output_token_seconds"
KV_USAGE = "kvmesh_kv_cache_usage_ratio"
QUEUED_PREFILL = "kvmesh_queued_prefill_tokens"
GPU_TIER = "gpu"


class MetricsSourceError(RuntimeError):
    """A metric source could not answer; the message names the endpoint and the cause."""


@dataclass(frozen=True)
class PoolTarget:
    """One pool to sample: its identity and, for the scrape source, its pods' endpoints."""

    namespace: str
    deployment: str  # the InferenceDeployment's name
    component: str
    endpoints: tuple[str, ...] = ()  # "host:port" of the pool's ready pods
    window_s: float = 60.0
    percentile: float = 95.0


class MetricsSource(Protocol):
    def sample(self, target: PoolTarget, now: float) -> PoolSample: ...


# ---- histogram quantile (Prometheus's interpolation) ----------------------------------------
def bucket_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """The q-quantile (0..1) of cumulative bucket counts {le: count}, as histogram_quantile.

    Linear interpolation inside the bucket that holds the rank; the lower edge
    of the first bucket is 0; a rank in the +Inf bucket answers the highest
    finite bound. None when the histogram is empty.
    """
    if not buckets or math.inf not in buckets:
        return None
    les = sorted(buckets)
    counts = [buckets[le] for le in les]
    for i in range(1, len(counts)):  # a scrape race can make counts dip; keep them monotonic
        counts[i] = max(counts[i], counts[i - 1])
    total = counts[-1]
    if total <= 0:
        return None
    rank = q * total
    i = next(i for i, c in enumerate(counts) if c >= rank)
    if les[i] == math.inf:
        return les[-2] if len(les) > 1 else None
    lo, below = (0.0, 0.0) if i == 0 else (les[i - 1], counts[i - 1])
    inside = counts[i] - below
    if inside <= 0:
        return les[i]
    return lo + (les[i] - lo) * (rank - below) / inside


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def buckets_of(samples: Samples, hist: str) -> dict[float, float]:
    """Cumulative bucket counts of `hist`, summed over every other label (sum by (le))."""
    out: dict[float, float] = {}
    for (name, labels), value in samples.items():
        if name != hist + "_bucket":
            continue
        le = float(dict(labels)["le"])
        out[le] = out.get(le, 0.0) + value
    return out


# ---- direct scrape ----------------------------------------------------------------------------
def http_get_text(url: str, timeout_s: float = 5.0) -> str:
    try:
        r = httpx.get(url, timeout=timeout_s)
        r.raise_for_status()
    except httpx.HTTPError as exc:
        raise MetricsSourceError(f"GET {url}: {exc}") from exc
    return r.text


@dataclass
class PodScrapeSource:
    """Scrapes the pods' /metrics itself and keeps one window of scrapes per pod.

    Invariant: `_scrapes[endpoint]` is ordered by time and holds no scrape
    older than the longest window asked for plus one (the baseline).
    """

    fetch: Callable[[str], str] = http_get_text
    _scrapes: dict[str, list[tuple[float, Samples]]] = field(default_factory=dict, repr=False)

    def _scrape(self, endpoint: str, now: float, window_s: float) -> tuple[Samples, Samples | None]:
        """(latest samples, the oldest scrape inside the window or None).

        Like `rate()`, only scrapes inside [now - window, now] count, so traffic
        that finished before the window never shows up in its percentiles.
        """
        latest = parse_samples(self.fetch(f"http://{endpoint}/metrics"))
        kept = self._scrapes.setdefault(endpoint, [])
        kept.append((now, latest))
        while kept[0][0] < now - window_s:
            kept.pop(0)
        base = kept[0][1] if len(kept) > 1 else None
        return latest, base

    def sample(self, target: PoolTarget, now: float) -> PoolSample:
        q = target.percentile / 100.0
        hist: dict[str, dict[float, float]] = {TTFT: {}, TPOT: {}}
        kv: list[float] = []
        queued = 0.0
        pods = 0
        for endpoint in target.endpoints:
            try:
                latest, base = self._scrape(endpoint, now, target.window_s)
            except MetricsSourceError:
                continue  # a pod going away: the others still speak for the pool
            pods += 1
            usage = sample_value(latest, KV_USAGE, tier=GPU_TIER)
            if usage is not None:
                kv.append(usage)
            queued += sample_value(latest, QUEUED_PREFILL) or 0.0
            if base is None:
                continue
            for name, acc in hist.items():
                now_b, then_b = buckets_of(latest, name), buckets_of(base, name)
                for le, count in now_b.items():
                    # A restarted pod's counters start over: count from zero then.
                    delta = count - then_b.get(le, 0.0)
                    acc[le] = acc.get(le, 0.0) + (delta if delta >= 0 else count)
        self._forget_stale(now, 2 * target.window_s)
        return PoolSample(
            t=now, pods=pods,
            kv_occupancy=sum(kv) / len(kv) if kv else None,
            queued_prefill_tokens=queued if pods else None,
            ttft_s=bucket_quantile(q, hist[TTFT]), tpot_s=bucket_quantile(q, hist[TPOT]))

    def _forget_stale(self, now: float, age_s: float) -> None:
        """Drop pods not scraped for `age_s` (gone, or no longer in any pool)."""
        for endpoint in [e for e, kept in self._scrapes.items() if kept[-1][0] < now - age_s]:
            del self._scrapes[endpoint]


# ---- Prometheus -----------------------------------------------------------------------------
def kubernetes_selector(target: PoolTarget) -> str:
    """Label matchers for a pool's pods as Prometheus's Kubernetes discovery labels them."""
    return (f'namespace="{target.namespace}",'
            f'pod=~"{target.deployment}-{target.component}-[a-z0-9]+-[a-z0-9]+"')


@dataclass
class PrometheusSource:
    """Instant queries against Prometheus's HTTP API (`/api/v1/query`).

    `selector(target)` gives the label matchers that pick the pool's series;
    the default matches the `namespace`/`pod` labels of Kubernetes discovery.
    `now` is passed as the query's evaluation time, so it must be Unix time.
    """

    url: str
    selector: Callable[[PoolTarget], str] = kubernetes_selector
    timeout_s: float = 10.0

    def query(self, promql: str, now: float) -> list[tuple[dict[str, str], float]]:
        endpoint = self.url.rstrip("/") + "/api/v1/query"
        try:
            r = httpx.get(endpoint, params={"query": promql, "time": f"{now:.3f}"},
                          timeout=self.timeout_s)
            body = r.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise MetricsSourceError(f"Prometheus {endpoint}: {exc}") from exc
        if body.get("status") != "success":
            raise MetricsSourceError(f"Prometheus rejected {promql!r}: {body.get('error', body)}")
        out = []
        for item in body["data"]["result"]:
            value = float(item["value"][1])
            if not math.isnan(value):
                out.append((item["metric"], value))
        return out

    def scalar(self, promql: str, now: float) -> float | None:
        result = self.query(promql, now)
        return result[0][1] if result else None

    def sample(self, target: PoolTarget, now: float) -> PoolSample:
        sel = self.selector(target)
        w = f"{max(1, int(round(target.window_s)))}s"
        q = target.percentile / 100.0

        def quantile(hist: str) -> float | None:
            return self.scalar(
                f"histogram_quantile({q}, sum by (le) (rate({hist}_bucket{{{sel}}}[{w}])))", now)

        pods = self.scalar(f'count({KV_USAGE}{{{sel},tier="{GPU_TIER}"}})', now)
        return PoolSample(
            t=now, pods=int(pods or 0),
            kv_occupancy=self.scalar(f'avg({KV_USAGE}{{{sel},tier="{GPU_TIER}"}})', now),
            queued_prefill_tokens=self.scalar(f"sum({QUEUED_PREFILL}{{{sel}}})", now),
            ttft_s=quantile(TTFT), tpot_s=quantile(TPOT))


def sources_agree(a: PoolSample, b: PoolSample, rel: float = 0.35, kv_abs: float = 0.15) -> Sequence[str]:
    """Fields where two samples of the same traffic disagree (for tests and debugging).

    Percentiles are windowed, so they must agree within `rel`; occupancy is a
    gauge the two read up to a scrape interval apart, so within `kv_abs`.
    """
    bad = []
    for name in ("kv_occupancy", "ttft_s", "tpot_s"):
        x, y = getattr(a, name), getattr(b, name)
        if (x is None) != (y is None):
            bad.append(f"{name}: {x} vs {y}")
        elif x is None:
            continue
        elif name == "kv_occupancy" and abs(x - y) > kv_abs:
            bad.append(f"{name}: {x:.3f} vs {y:.3f}")
        elif name != "kv_occupancy" and abs(x - y) > rel * max(abs(x), abs(y), 1e-9):
            bad.append(f"{name}: {x:.4g} vs {y:.4g}")
    return bad
