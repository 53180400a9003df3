"""The autoscaling decision: a pure function of (spec, metrics window, state, now).

`decide` never does I/O and never reads a clock: the metric sources
(metrics_source.py) fill a `MetricsWindow`, the caller passes the previous
`AutoscalerState` and `now`, and gets back one `Decision` per autoscaled pool
plus the next state. The same inputs always give the same outputs, which is
what the tests in tests/operator/test_autoscaler.py rely on.

Policy (docs/operator.md, "Autoscaling", has the formulas):
- each pool has capacity signals (KV occupancy vs `kvOccupancyTarget`,
  queued prefill tokens per replica vs `Policy.queued_prefill_tokens_per_replica`)
  and latency signals (TTFT / TPOT at the SLO percentile vs `slo.ttftMs` /
  `slo.tpotMs`); every signal is a ratio observed / target;
- which signal drives which pool: colocated, the one pool (`decode`, role both)
  has all four, its latencies from its own engines. Disaggregated, the prefill
  pool scales on queued prefill tokens and TTFT, the decode pool on KV occupancy
  and TPOT, and both latencies are the router's end-to-end percentiles (where
  the client waits: a decode engine's own TTFT starts at stage 2), with the
  pool's own engines standing in while the router has none; the metric sources
  choose (metrics_source.latency_histograms), `PoolSample.ttft_from` /
  `tpot_from` record it and the decision's message names it;
- any ratio above 1 + tolerance asks for ceil(pods * ratio) replicas (at most
  doubling per step); a scale-down needs every latency signal within its SLO
  and every capacity ratio below 1 - tolerance, asks for ceil(pods * ratio),
  and removes at most one pod per step (each victim is drained first);
- the raw recommendation is clamped to [min, max] and recorded; a scale-up
  takes the lowest recommendation of the scale-up window, a scale-down the
  highest of the scale-down window (as the HPA does), and neither acts before
  the autoscaler has observed the pool for that whole window. An oscillating
  input therefore holds the replica count where it is.

Invariants: min <= desired <= max for every decision (except a pool already
outside its bounds, which moves straight to the nearest bound); a decision
lowers replicas by at most one; the returned state's history holds only
recommendations younger than the longer stabilization window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Mapping

from . import spec as s

# Pools the autoscaler may resize; the cache nodes and the router are sized by hand.
AUTOSCALED = ("prefill", "decode")


@dataclass(frozen=True)
class Policy:
    """Tunables that the CRD does not (yet) expose; defaults documented in docs/operator.md."""

    tolerance: float = 0.1
    # A prefill replica works through about one engine step's token budget
    # (`--max-num-batched-tokens`, 2048) at a time; more queued than that per
    # replica means prompts wait for steps they are not in.
    queued_prefill_tokens_per_replica: float = 2048.0
    max_scale_up_factor: float = 2.0


@dataclass(frozen=True)
class PoolSample:
    """One observation of a pool at time `t` (seconds, any monotonic origin).

    Latencies are the SLO percentile over the metrics window ending at `t`
    (None: no request finished in it); gauges are as read at `t`.
    """

    t: float
    pods: int  # pods that answered the scrape (or had series in Prometheus)
    kv_occupancy: float | None = None  # mean over the pods, 0..1
    queued_prefill_tokens: float | None = None  # sum over the pods
    ttft_s: float | None = None
    tpot_s: float | None = None
    # Whose histograms the latencies are: "engines" (the pool's own) or "router" (end to end).
    ttft_from: str = "engines"
    tpot_from: str = "engines"


@dataclass(frozen=True)
class MetricsWindow:
    """Samples per pool (by component name), oldest first."""

    pools: Mapping[str, tuple[PoolSample, ...]] = field(default_factory=dict)

    def recent(self, component: str, since: float) -> tuple[PoolSample, ...]:
        return tuple(x for x in self.pools.get(component, ()) if x.t >= since)


@dataclass(frozen=True)
class Recommendation:
    t: float
    replicas: int


@dataclass(frozen=True)
class Decision:
    """What the autoscaler wants for one pool, and why (reason is CamelCase, for status and Events)."""

    component: str
    current: int
    desired: int
    reason: str
    message: str
    t: float
    slo_met: bool | None = None  # None: no SLO set, or no latency observed

    @property
    def scales(self) -> bool:
        return self.desired != self.current


@dataclass(frozen=True)
class AutoscalerState:
    """What decide() needs from earlier passes, plus the pools' current replicas.

    `replicas` is the size each pool has now (the Deployment's spec.replicas);
    the caller refreshes it from the cluster before each call.
    """

    replicas: Mapping[str, int] = field(default_factory=dict)
    history: Mapping[str, tuple[Recommendation, ...]] = field(default_factory=dict)
    observing_since: Mapping[str, float] = field(default_factory=dict)
    last: Mapping[str, Decision] = field(default_factory=dict)


@dataclass(frozen=True)
class Signal:
    name: str  # kv, queue, ttft, tpot
    ratio: float  # observed / target
    latency: bool
    text: str


_UP_REASON = {"kv": "KVOccupancyHigh", "queue": "PrefillQueueHigh",
              "ttft": "TTFTAboveSLO", "tpot": "TPOTAboveSLO"}


def autoscaled_pools(spec: s.InferenceSpec) -> tuple[str, ...]:
    """The colocated pool is `decode` (role both); prefill is resized only while it exists."""
    return ("decode",) if spec.colocated else AUTOSCALED


def bounds(spec: s.InferenceSpec, component: str) -> tuple[int, int]:
    """[min, max] for a pool; an unset bound is the pool's `replicas` (as the CRD documents)."""
    c = spec.component(component)
    lo = c.replicas if c.min_replicas is None else c.min_replicas
    hi = c.replicas if c.max_replicas is None else c.max_replicas
    # A disaggregated deployment needs at least one engine per phase: prefill at
    # 0 would mean colocated serving, which only spec.prefill.replicas switches.
    lo = max(lo, 1)
    return lo, max(lo, hi)


def _signals(spec: s.InferenceSpec, component: str, samples: tuple[PoolSample, ...],
             policy: Policy) -> list[Signal]:
    """Ratios for the pool's signals that have data. Gauges are averaged over
    the window; latencies are the latest percentile (already windowed)."""
    colocated = spec.colocated
    decode_like = component == "decode"
    prefill_like = component == "prefill" or colocated
    out: list[Signal] = []
    pct = f"p{spec.slo.percentile:g}"

    def mean(values: list[float | None]) -> float | None:
        vals = [v for v in values if v is not None]
        return sum(vals) / len(vals) if vals else None

    latest = samples[-1]

    def origin(who: str) -> str:
        return " end to end" if who == "router" else ""
    if decode_like:
        kv = mean([x.kv_occupancy for x in samples])
        target = spec.autoscaling.kv_occupancy_target
        if kv is not None:
            out.append(Signal("kv", kv / target, False, f"KV occupancy {kv:.2f} / target {target:.2f}"))
        if spec.slo.tpot_ms and latest.tpot_s is not None:
            ms = latest.tpot_s * 1000
            out.append(Signal("tpot", ms / spec.slo.tpot_ms, True,
                              f"TPOT{origin(latest.tpot_from)} {pct} {ms:.0f}ms / SLO {spec.slo.tpot_ms}ms"))
    if prefill_like:
        queued = mean([x.queued_prefill_tokens for x in samples])
        if queued is not None and latest.pods > 0:
            per = queued / latest.pods
            target = policy.queued_prefill_tokens_per_replica
            out.append(Signal("queue", per / target, False,
                              f"queued prefill tokens {per:.0f}/replica / target {target:.0f}"))
        if spec.slo.ttft_ms and latest.ttft_s is not None:
            ms = latest.ttft_s * 1000
            out.append(Signal("ttft", ms / spec.slo.ttft_ms, True,
                              f"TTFT{origin(latest.ttft_from)} {pct} {ms:.0f}ms / SLO {spec.slo.ttft_ms}ms"))
    return out


def slo_met(signals: list[Signal]) -> bool | None:
    lat = [x for x in signals if x.latency]
    return None if not lat else all(x.ratio <= 1.0 for x in lat)


def recommend(current: int, pods: int, signals: list[Signal], policy: Policy) -> tuple[int, str, str]:
    """Raw (unclamped, unstabilized) replicas for one pool: (replicas, reason, message)."""
    text = "; ".join(x.text for x in signals)
    if not signals or pods <= 0:
        return current, "NoMetrics", "no pod reported metrics in the window"
    top = max(signals, key=lambda x: x.ratio)
    if top.ratio > 1.0 + policy.tolerance:
        cap = max(current + 1, math.floor(current * policy.max_scale_up_factor))
        # Pods still starting are counted as capacity on the way: want more
        # only if the pods that report are not enough even with them.
        want = min(cap, math.ceil(pods * top.ratio))
        return max(current, want), _UP_REASON[top.name], text
    capacity = [x for x in signals if not x.latency]
    if (capacity and pods >= current and slo_met(signals) is not False
            and max(x.ratio for x in capacity) < 1.0 - policy.tolerance):
        # Not capped at current - 1 here: the history keeps what the load asks
        # for, and the decision removes one pod per step (each one drained first).
        want = math.ceil(pods * max(x.ratio for x in capacity))
        if want < current:
            return want, "UnderUtilized", text
    return current, "WithinTarget", text


def _covered(since: float | None, now: float, window: float) -> bool:
    return since is not None and now - since >= window


def _decide_pool(spec: s.InferenceSpec, component: str, window: MetricsWindow,
                 state: AutoscalerState, now: float, policy: Policy
                 ) -> tuple[Decision, tuple[Recommendation, ...], float | None]:
    a = spec.autoscaling
    lo, hi = bounds(spec, component)
    current = int(state.replicas.get(component, spec.component(component).replicas))
    since = state.observing_since.get(component)
    history = state.history.get(component, ())
    samples = window.recent(component, now - a.metrics_window_seconds)
    signals = _signals(spec, component, samples, policy) if samples else []
    met = slo_met(signals)

    def out(desired: int, reason: str, message: str) -> Decision:
        return Decision(component, current, desired, reason, message, now, met)

    # Bounds edited under a running pool: move to the nearest bound at once.
    if current < lo:
        return out(lo, "BelowMinReplicas", f"{current} < minReplicas {lo}"), (), None
    if current > hi:
        return out(hi, "AboveMaxReplicas", f"{current} > maxReplicas {hi}"), (), None
    if not samples:
        return out(current, "NoMetrics", "no samples in the metrics window"), history, since

    pods = samples[-1].pods
    raw, reason, message = recommend(current, pods, signals, policy)
    rec = min(hi, max(lo, raw))
    since = now if since is None else since
    keep = max(a.scale_up_stabilization_seconds, a.scale_down_stabilization_seconds)
    history = tuple(r for r in history if r.t >= now - keep) + (Recommendation(now, rec),)
    ups = [r.replicas for r in history if r.t >= now - a.scale_up_stabilization_seconds]
    downs = [r.replicas for r in history if r.t >= now - a.scale_down_stabilization_seconds]
    up, down = min(ups), max(downs)
    if up > current and _covered(since, now, a.scale_up_stabilization_seconds):
        return out(up, reason, message), history, since
    if down < current and _covered(since, now, a.scale_down_stabilization_seconds):
        return out(max(down, current - 1), reason, message), history, since
    if rec > current:
        return out(current, "ScaleUpStabilizing",
                   f"wants {rec} for {a.scale_up_stabilization_seconds}s first; {message}"), history, since
    if rec < current:
        return out(current, "ScaleDownStabilizing",
                   f"wants {rec} for {a.scale_down_stabilization_seconds}s first; {message}"), history, since
    if raw != rec:
        reason = "AtMaxReplicas" if raw > rec else "AtMinReplicas"
        message = f"bounds [{lo}, {hi}]; {message}"
    return out(current, reason, message), history, since


def decide(spec: s.InferenceSpec, window: MetricsWindow, state: AutoscalerState, now: float,
           policy: Policy = Policy()) -> tuple[dict[str, Decision], AutoscalerState]:
    """One decision per autoscaled pool and the state for the next call.

    With autoscaling off the decisions hold every pool at its current size
    (reason AutoscalingDisabled) but still report whether the SLO is met.
    """
    decisions: dict[str, Decision] = {}
    history: dict[str, tuple[Recommendation, ...]] = {}
    observing: dict[str, float] = {}
    for component in autoscaled_pools(spec):
        if not spec.autoscaling.enabled:
            current = int(state.replicas.get(component, spec.component(component).replicas))
            samples = window.recent(component, now - spec.autoscaling.metrics_window_seconds)
            met = slo_met(_signals(spec, component, samples, policy)) if samples else None
            decisions[component] = Decision(component, current, current, "AutoscalingDisabled",
                                            "spec.autoscaling.enabled is false", now, met)
            continue
        d, hist, since = _decide_pool(spec, component, window, state, now, policy)
        decisions[component] = d
        if hist:
            history[component] = hist
        if since is not None:
            observing[component] = since
    replicas = {**state.replicas, **{c: d.desired for c, d in decisions.items()}}
    last = {**state.last, **decisions}
    return decisions, replace(state, replicas=replicas, history=history,
                              observing_since=observing, last=last)


def effective_replicas(spec: s.InferenceSpec, status: Mapping[str, object] | None) -> dict[str, int]:
    """The replicas each pool's Deployment gets: `spec.<pool>.replicas`, except
    that with autoscaling on, a resized pool keeps the autoscaler's last choice
    (`status.autoscaling.<pool>.desiredReplicas`, written before it scales),
    clamped to the pool's bounds. Reading it from the status keeps the choice
    across operator restarts and makes the render pass agree with the autoscaler.
    """
    out = {c: spec.component(c).replicas for c in s.COMPONENTS}
    if not spec.autoscaling.enabled:
        return out
    auto = (status or {}).get("autoscaling") or {}
    for c in autoscaled_pools(spec):
        lo, hi = bounds(spec, c)
        chosen = (auto.get(c) or {}).get("desiredReplicas") if isinstance(auto, Mapping) else None
        out[c] = min(hi, max(lo, int(chosen))) if chosen is not None else min(hi, max(lo, out[c]))
    return out
