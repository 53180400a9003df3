"""The autoscaler's control loop: sample, decide, act, report (one `tick` per CR).

Everything with side effects comes in through `AutoscaleIO` and the
`MetricsSource`, so a tick runs the same against fakes (tests) and the
cluster (app.py). Per InferenceDeployment it keeps in memory the samples of
the last metrics window and the decision state; after an operator restart
the autoscaler observes for a full stabilization window before acting again
(autoscaler.decide's rule), the replicas it chose survive in
`status.autoscaling` (effective_replicas), and a drain in progress survives on
its pod (scaling.DRAIN_ANNOTATION), which the first tick of each pool adopts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any

from . import spec as s
from .autoscaler import AutoscalerState, Decision, MetricsWindow, PoolSample, autoscaled_pools, decide, \
    effective_replicas
from .metrics import OperatorMetrics
from .metrics_source import MetricsSource, MetricsSourceError, PoolTarget
from .routing_status import ROUTING, routing_condition
from .scaling import PodInfo, PoolScaler

log = logging.getLogger("kvmesh.operator")


@dataclass
class AutoscaleIO:
    """Cluster and engine effects, per InferenceDeployment (namespace, name)."""

    ready_pods: Callable[[str, str, str], list[PodInfo]]  # (ns, name, pool)
    start_drain: Callable[[PodInfo], None]  # also renews the drain's lease
    cancel_drain: Callable[[PodInfo], None]
    in_flight: Callable[[PodInfo], int | None]
    is_draining: Callable[[PodInfo], bool | None]
    record_drain: Callable[[str, PodInfo, str | None], None]  # (ns, pod, annotation or None)
    recorded_drains: Callable[[str, str, str], list[tuple[PodInfo, str]]]  # (ns, name, pool)
    mark_for_deletion: Callable[[str, PodInfo], None]  # (ns, pod)
    patch_status: Callable[[str, str, Mapping[str, Any]], None]  # merge patch of .status
    apply_replicas: Callable[[str, str], None]  # (ns, name): a reconcile pass
    event: Callable[[Mapping[str, Any], str, str], None]  # (object, reason, message)
    # (ns, name) -> the ready router pods' host:port: the end-to-end latency of P/D deployments
    router_endpoints: Callable[[str, str], tuple[str, ...]] = lambda ns, name: ()
    # (ns, name) -> each router pod's (name, /ready body or None): the CacheAwareRouting condition
    router_readiness: Callable[[str, str], list[tuple[str, Mapping[str, Any] | None]]] = lambda ns, name: []


def rfc3339(unix: float) -> str:
    return datetime.fromtimestamp(unix, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class _Tracked:
    samples: dict[str, list[PoolSample]] = field(default_factory=dict)
    state: AutoscalerState = field(default_factory=AutoscalerState)
    scalers: dict[str, PoolScaler] = field(default_factory=dict)
    last_scale: dict[str, float] = field(default_factory=dict)


class _PoolIO:
    """ScaleIO for one CR's pools: replicas go through the status, then a reconcile pass."""

    def __init__(self, runner: "AutoscaleRunner", obj: Mapping[str, Any], tracked: _Tracked,
                 now: float) -> None:
        self.r, self.obj, self.t, self.now = runner, obj, tracked, now
        meta = obj["metadata"]
        self.ns, self.name = meta["namespace"], meta["name"]

    def ready_pods(self, pool: str) -> list[PodInfo]:
        return self.r.io.ready_pods(self.ns, self.name, pool)

    def start_drain(self, pod: PodInfo) -> None:
        self.r.io.start_drain(pod)

    def cancel_drain(self, pod: PodInfo) -> None:
        self.r.io.cancel_drain(pod)

    def in_flight(self, pod: PodInfo) -> int | None:
        return self.r.io.in_flight(pod)

    def is_draining(self, pod: PodInfo) -> bool | None:
        return self.r.io.is_draining(pod)

    def record_drain(self, pool: str, pod: PodInfo, record: str | None) -> None:
        self.r.io.record_drain(self.ns, pod, record)

    def recorded_drains(self, pool: str) -> list[tuple[PodInfo, str]]:
        return self.r.io.recorded_drains(self.ns, self.name, pool)

    def mark_for_deletion(self, pool: str, pod: PodInfo) -> None:
        self.r.io.mark_for_deletion(self.ns, pod)

    def set_replicas(self, pool: str, replicas: int) -> None:
        # The status is the record the render pass reads, so write it first.
        self.t.last_scale[pool] = self.now
        self.r.io.patch_status(self.ns, self.name, {"autoscaling": {pool: {
            "desiredReplicas": replicas, "lastScaleTime": rfc3339(self.now)}}})
        self.r.io.apply_replicas(self.ns, self.name)

    def event(self, pool: str, reason: str, message: str) -> None:
        self.r.io.event(self.obj, reason, message)


def _changed(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """Whether `new` says anything beyond a fresher lastDecisionTime: each status
    write is a watch event and a reconcile pass, so an unchanged one is skipped."""
    def strip(pools: Any) -> dict:
        return {p: {k: v for k, v in (e or {}).items() if k != "lastDecisionTime"}
                for p, e in (pools or {}).items()}
    old_pools = strip(old.get("autoscaling"))
    if any(old_pools.get(p, {}).get(k) != v for p, e in strip(new["autoscaling"]).items()
           for k, v in e.items()):
        return True
    return list(old.get("conditions") or []) != new["conditions"]


@dataclass
class AutoscaleRunner:
    source: MetricsSource
    io: AutoscaleIO
    port: int = 8000
    metrics: OperatorMetrics | None = None
    _tracked: dict[tuple[str, str], _Tracked] = field(default_factory=dict, repr=False)

    def forget(self, namespace: str, name: str) -> None:
        self._tracked.pop((namespace, name), None)

    def retain(self, alive: list[tuple[str, str]]) -> None:
        """Forget every InferenceDeployment not in `alive` (namespace, name): it was deleted."""
        for key in [k for k in self._tracked if k not in set(alive)]:
            self.forget(*key)
        if self.metrics is not None:
            self.metrics.retain(alive)

    def tick(self, obj: Mapping[str, Any], now: float) -> dict[str, Decision]:
        """One round for one CR at Unix time `now`; returns the decisions taken."""
        meta = obj["metadata"]
        ns, name = meta["namespace"], meta["name"]
        spec = s.parse_spec(obj.get("spec") or {})
        tracked = self._tracked.setdefault((ns, name), _Tracked())
        window_s = spec.autoscaling.metrics_window_seconds
        # Disaggregated, latency is the router's end to end (metrics_source.latency_histograms).
        routers = () if spec.colocated else self.io.router_endpoints(ns, name)
        for pool in autoscaled_pools(spec):
            pods = self.io.ready_pods(ns, name, pool)
            target = PoolTarget(ns, name, pool, tuple(p.endpoint for p in pods), window_s,
                                spec.slo.percentile, disaggregated=not spec.colocated, routers=routers)
            try:
                sample = self.source.sample(target, now)
            except MetricsSourceError as exc:
                log.warning("%s/%s %s: no metrics this round: %s", ns, name, pool, exc)
                continue
            kept = [x for x in tracked.samples.get(pool, []) if x.t >= now - window_s]
            tracked.samples[pool] = kept + [sample]
        window = MetricsWindow({p: tuple(v) for p, v in tracked.samples.items()})
        current = effective_replicas(spec, obj.get("status"))
        state = replace(tracked.state, replicas={p: current[p] for p in autoscaled_pools(spec)})
        decisions, tracked.state = decide(spec, window, state, now)
        if self.metrics is not None:
            self.metrics.record_decisions(ns, name, decisions)
        pool_io = _PoolIO(self, obj, tracked, now)
        for pool, d in decisions.items():
            if not spec.autoscaling.enabled:
                continue
            scaler = tracked.scalers.get(pool)
            if scaler is None:
                scaler = tracked.scalers[pool] = PoolScaler(
                    pool, pool_io, spec.component(pool).termination_grace_period_seconds)
                adopted = scaler.adopt()
                if adopted is not None:
                    log.info("%s/%s %s: %s", ns, name, pool, adopted)
                    if self.metrics is not None:
                        self.metrics.record_step(ns, name, pool, adopted)
            scaler.io = pool_io
            outcome = scaler.step(d, now)
            if outcome not in ("hold", "draining"):
                log.info("%s/%s %s: %s (%s: %s)", ns, name, pool, outcome, d.reason, d.message)
            if self.metrics is not None:
                self.metrics.record_step(ns, name, pool, outcome)
        status = self.status(obj, decisions, tracked, now)
        routing = routing_condition(
            spec.router.policy or "", self.io.router_readiness(ns, name) if spec.router.replicas else [],
            next((c for c in (obj.get("status") or {}).get("conditions") or () if c.get("type") == ROUTING), None),
            rfc3339(now), int(meta.get("generation", 0)))
        status["conditions"] = [c for c in status["conditions"] if c.get("type") != ROUTING] + (
            [routing] if routing else [])
        if _changed(obj.get("status") or {}, status):
            self.io.patch_status(ns, name, status)
        return decisions

    def status(self, obj: Mapping[str, Any], decisions: Mapping[str, Decision], tracked: _Tracked,
               now: float) -> dict[str, Any]:
        """status.autoscaling for the pools and the SLOMet condition."""
        pools: dict[str, Any] = {}
        for pool, d in decisions.items():
            scaler = tracked.scalers.get(pool)
            entry: dict[str, Any] = {
                "currentReplicas": d.current, "reason": d.reason, "message": d.message,
                "lastDecisionTime": rfc3339(d.t),
                "drainingPod": scaler.draining.pod.name if scaler and scaler.draining else None,
            }
            if d.desired > d.current and (scaler is None or scaler.draining is None):
                # A scale-up (step() just made it, cancelling any drain); a scale-down is
                # recorded by the scaler when its drain ends.
                entry["desiredReplicas"] = d.desired
            pools[pool] = entry
        met = [d.slo_met for d in decisions.values()]
        if any(m is False for m in met):
            value, reason = "False", "SLOMissed"
        elif met and all(m is True for m in met):
            value, reason = "True", "WithinSLO"
        else:
            value, reason = "Unknown", "NoLatencyData"
        message = "; ".join(f"{p}: {d.message}" for p, d in decisions.items() if d.message)
        previous = next((c for c in (obj.get("status") or {}).get("conditions") or ()
                         if c.get("type") == "SLOMet"), None)
        changed = previous is None or previous.get("status") != value
        condition = {"type": "SLOMet", "status": value, "reason": reason, "message": message,
                     "lastTransitionTime": rfc3339(now) if changed
                     else previous.get("lastTransitionTime", rfc3339(now)),
                     "observedGeneration": int(obj["metadata"].get("generation", 0))}
        others = [c for c in (obj.get("status") or {}).get("conditions") or ()
                  if c.get("type") != "SLOMet"]
        return {"autoscaling": pools, "conditions": others + [condition]}
