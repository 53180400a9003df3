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

Latency per pool (`latency_histograms`, shared by both sources):

- colocated (no prefill pool): TTFT and TPOT from the pool's own engines, as before. The router's
  end-to-end series are not clearly better there: an engine's TTFT already spans its arrival to
  its first token (routing adds well under a millisecond), it times a non-streamed request's
  first token exactly where the router sees only the whole body, and it needs no router pods.
- disaggregated (a prefill pool): a decode engine's TTFT starts at stage 2 (near zero) and a
  prefill engine's misses the router's wait for decode room and the KV transfer, so latency
  comes from the router's end-to-end histograms (engine/router/slo.py): `ttft_s` from
  `kvmesh_router_time_to_first_token_seconds{stream="true"}` (drives the prefill pool), `tpot_s`
  from `kvmesh_router_time_per_output_token_seconds` (drives the decode pool). When the router's
  histogram has no observation in the window (its pods not scraped, only non-streamed traffic,
  an older router) the pool's engines stand in: the prefill engines' TTFT, the decode engines'
  TPOT (the same pace less the network); never the decode engines' TTFT.
  The router's pods are `target.routers` for the scrape source, and the selector with
  component "router" for Prometheus. `PoolSample.ttft_from` / `tpot_from` say which answered.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import httpx

from kvmesh.engine.util.metrics import ROUTER_TPOT, ROUTER_TTFT, STREAM_LABEL, parse_samples, sample_value

from .autoscaler import PoolSample

TTFT = "kvmesh_time_to_first_token_seconds"
TPOT = "kvmesh_time_per_output_token_seconds"
KV_USAGE = "kvmesh_kv_cache_usage_ratio"
QUEUED_PREFILL = "kvmesh_queued_prefill_tokens"
GPU_TIER = "gpu"
ROUTER = "router"  # the router's component name (render.py), whose pods export the end-to-end series
ENGINES = "engines"


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
    disaggregated: bool = False  # the deployment has a prefill pool: latency from the router
    routers: tuple[str, ...] = ()  # "host:port" of the router's ready pods (the scrape source reads them)


class MetricsSource(Protocol):
    def sample(self, target: PoolTarget, now: float) -> PoolSample: ...


@dataclass(frozen=True)
class Hist:
    """One latency histogram to read: whose pods export it (ROUTER or ENGINES: the target's own),
    its name, and the labels its series must carry."""

    origin: str
    name: str
    labels: tuple[tuple[str, str], ...] = ()


def latency_histograms(target: PoolTarget) -> dict[str, tuple[Hist, ...]]:
    """For "ttft" and "tpot": the histograms that may give the pool's percentile, preferred first
    (the first with an observation in the window answers). The module doc says why."""
    engines_ttft, engines_tpot = Hist(ENGINES, TTFT), Hist(ENGINES, TPOT)
    if not target.disaggregated:
        return {"ttft": (engines_ttft,), "tpot": (engines_tpot,)}
    router_ttft = Hist(ROUTER, ROUTER_TTFT, ((STREAM_LABEL, "true"),))
    router_tpot = Hist(ROUTER, ROUTER_TPOT)
    if target.component == "decode":
        return {"ttft": (router_ttft,), "tpot": (router_tpot, engines_tpot)}
    return {"ttft": (router_ttft, engines_ttft), "tpot": (router_tpot, engines_tpot)}


def first_answer(values: Sequence[tuple[str, float | None]]) -> tuple[float | None, str | None]:
    """(value, origin) of the first (origin, value) with a value; (None, None) when none has one."""
    return next(((v, origin) for origin, v in values if v is not None), (None, None))


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


def buckets_of(samples: Samples, hist: str, labels: tuple[tuple[str, str], ...] = ()) -> dict[float, float]:
    """Cumulative bucket counts of `hist`'s series that carry `labels`, summed over every other
    label (sum by (le))."""
    out: dict[float, float] = {}
    want = set(labels)
    for (name, series_labels), value in samples.items():
        if name != hist + "_bucket" or not want <= series_labels:
            continue
        le = float(dict(series_labels)["le"])
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
        that finished before the window never shows up in its percentiles. A pod
        already scraped at this `now` (a router, asked for by each pool) is not
        scraped again.
        """
        kept = self._scrapes.get(endpoint, [])
        if not kept or kept[-1][0] != now:
            latest = parse_samples(self.fetch(f"http://{endpoint}/metrics"))  # raises before anything is kept
            kept = self._scrapes.setdefault(endpoint, [])
            kept.append((now, latest))
        while kept[0][0] < now - window_s:
            kept.pop(0)
        base = kept[0][1] if len(kept) > 1 else None
        return kept[-1][1], base

    def _window_buckets(self, endpoints: Sequence[str], hists: Sequence[Hist], now: float, window_s: float,
                        on_latest: Callable[[Samples], None] | None = None) -> tuple[int, dict[Hist, dict]]:
        """(pods that answered, per histogram the bucket counts added in the window, summed over
        those pods). `on_latest` sees each answering pod's latest scrape (the gauges)."""
        acc: dict[Hist, dict[float, float]] = {h: {} for h in hists}
        pods = 0
        for endpoint in endpoints:
            try:
                latest, base = self._scrape(endpoint, now, window_s)
            except MetricsSourceError:
                continue  # a pod going away: the others still speak for the pool
            pods += 1
            if on_latest is not None:
                on_latest(latest)
            if base is None:
                continue
            for h, out in acc.items():
                now_b, then_b = buckets_of(latest, h.name, h.labels), buckets_of(base, h.name, h.labels)
                for le, count in now_b.items():
                    # A restarted pod's counters start over: count from zero then.
                    delta = count - then_b.get(le, 0.0)
                    out[le] = out.get(le, 0.0) + (delta if delta >= 0 else count)
        return pods, acc

    def sample(self, target: PoolTarget, now: float) -> PoolSample:
        q = target.percentile / 100.0
        wanted = latency_histograms(target)
        kv: list[float] = []
        queued = [0.0]

        def gauges(latest: Samples) -> None:
            usage = sample_value(latest, KV_USAGE, tier=GPU_TIER)
            if usage is not None:
                kv.append(usage)
            queued[0] += sample_value(latest, QUEUED_PREFILL) or 0.0

        hists = {h for hs in wanted.values() for h in hs}
        pods, buckets = self._window_buckets(target.endpoints, [h for h in hists if h.origin == ENGINES], now,
                                             target.window_s, gauges)
        routers = [h for h in hists if h.origin == ROUTER]
        if routers:
            buckets.update(self._window_buckets(target.routers, routers, now, target.window_s)[1])
        self._forget_stale(now, 2 * target.window_s)
        (ttft, ttft_from), (tpot, tpot_from) = (
            first_answer([(h.origin, bucket_quantile(q, buckets[h])) for h in wanted[k]]) for k in ("ttft", "tpot"))
        return PoolSample(
            t=now, pods=pods,
            kv_occupancy=sum(kv) / len(kv) if kv else None,
            queued_prefill_tokens=queued[0] if pods else None,
            ttft_s=ttft, tpot_s=tpot, ttft_from=ttft_from or ENGINES, tpot_from=tpot_from or ENGINES)

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

        selectors = {ENGINES: sel, ROUTER: self.selector(replace(target, component=ROUTER))}

        def quantile(h: Hist) -> float | None:
            # No observation in the window: 0/0, NaN, which `query` drops.
            matchers = ",".join([selectors[h.origin]] + [f'{k}="{v}"' for k, v in h.labels])
            return self.scalar(
                f"histogram_quantile({q}, sum by (le) (rate({h.name}_bucket{{{matchers}}}[{w}])))", now)

        def latency(kind: str) -> tuple[float | None, str | None]:
            for h in latency_histograms(target)[kind]:  # in order, and only as far as needed
                v = quantile(h)
                if v is not None:
                    return v, h.origin
            return None, None

        pods = self.scalar(f'count({KV_USAGE}{{{sel},tier="{GPU_TIER}"}})', now)
        (ttft, ttft_from), (tpot, tpot_from) = latency("ttft"), latency("tpot")
        return PoolSample(
            t=now, pods=int(pods or 0),
            kv_occupancy=self.scalar(f'avg({KV_USAGE}{{{sel},tier="{GPU_TIER}"}})', now),
            queued_prefill_tokens=self.scalar(f"sum({QUEUED_PREFILL}{{{sel}}})", now),
            ttft_s=ttft, tpot_s=tpot, ttft_from=ttft_from or ENGINES, tpot_from=tpot_from or ENGINES)


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
