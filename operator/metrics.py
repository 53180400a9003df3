"""The operator's own Prometheus metrics: the autoscaler's decisions and drains.

Served on the health port at /metrics (health.py). Every series is labelled
`namespace`, `inference_deployment` and `component`: the InferenceDeployment's
namespace and name and the pool, the labels the SLO dashboard selects on. A
scrape must therefore keep these labels as exported (the chart's operator
PodMonitor sets `honorLabels: true`; otherwise Prometheus would rename
`namespace` to `exported_namespace` and set it to the operator's namespace).

    kvmesh_autoscaler_desired_replicas    gauge    last decision's desired replicas
    kvmesh_autoscaler_current_replicas    gauge    last decision's current replicas
    kvmesh_autoscaler_slo_met             gauge    1 within SLO, 0 missed; absent when unknown
    kvmesh_autoscaler_decisions_total     counter  decisions by direction (up, down, hold) and reason
    kvmesh_autoscaler_drains_started_total    counter  scale-down drains begun
    kvmesh_autoscaler_drains_finished_total   counter  victims that drained (or went away) in time
    kvmesh_autoscaler_drains_timed_out_total  counter  victims removed with requests left after
                                                       the grace period (their SIGTERM drain
                                                       lets those finish)
    kvmesh_autoscaler_drains_cancelled_total  counter  drains superseded by a scale-up
    kvmesh_autoscaler_drains_resumed_total    counter  drains a previous operator started, taken over

Invariants: started + resumed = finished + timed_out + cancelled + drains in
progress (at most one per pool); the gauges describe the latest decision of each pool of the
InferenceDeployments seen by the last `retain` call, and nothing else, so a
deleted InferenceDeployment's gauges disappear instead of going stale. The
registry belongs to the object (one per operator process or test).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric

from kvmesh.engine.util.metrics import CallbackCollector, counter, new_registry, render

from .autoscaler import Decision

LABELS = ("namespace", "inference_deployment", "component")
# step() outcomes of scaling.PoolScaler that end or begin a drain.
DRAIN_STARTED, DRAINED, DRAIN_TIMED_OUT = "drain-started", "drained", "drain-timed-out"
DRAIN_CANCELLED, DRAIN_RESUMED = "drain-cancelled", "drain-resumed"

PoolKey = tuple[str, str, str]  # (namespace, inference deployment, component)


def direction(d: Decision) -> str:
    if d.desired > d.current:
        return "up"
    if d.desired < d.current:
        return "down"
    return "hold"


@dataclass
class OperatorMetrics:
    """Counters updated as the autoscaler acts; gauges read from the last decisions at scrape time.

    Thread-safe: the autoscaler ticks in a worker thread while the event loop serves scrapes.
    """

    registry: CollectorRegistry = field(default_factory=new_registry)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[PoolKey, Decision] = {}
        self._decisions = counter(self.registry, "kvmesh_autoscaler_decisions_total",
                                  "Autoscaler decisions per pool, by direction (up, down, hold) and reason.",
                                  LABELS + ("direction", "reason"))
        self._drains = {
            DRAIN_STARTED: counter(self.registry, "kvmesh_autoscaler_drains_started_total",
                                   "Drains begun before a scale-down.", LABELS),
            DRAINED: counter(self.registry, "kvmesh_autoscaler_drains_finished_total",
                             "Drain victims that finished their requests (or went away) within the bound.",
                             LABELS),
            DRAIN_TIMED_OUT: counter(self.registry, "kvmesh_autoscaler_drains_timed_out_total",
                                     "Drain victims removed with requests still in flight after the "
                                     "pool's terminationGracePeriodSeconds.", LABELS),
            DRAIN_CANCELLED: counter(self.registry, "kvmesh_autoscaler_drains_cancelled_total",
                                     "Drains superseded by a scale-up (the victim serves again).", LABELS),
            DRAIN_RESUMED: counter(self.registry, "kvmesh_autoscaler_drains_resumed_total",
                                   "Drains recorded on a pod by a previous operator and taken over.", LABELS),
        }
        self.registry.register(CallbackCollector(self._gauges))

    def record_decisions(self, namespace: str, name: str, decisions: Mapping[str, Decision]) -> None:
        """One autoscaler tick's decisions for one InferenceDeployment."""
        with self._lock:
            for pool in [k for k in self._last if k[:2] == (namespace, name) and k[2] not in decisions]:
                del self._last[pool]  # a pool that is no longer autoscaled (e.g. prefill went to 0)
            for pool, d in decisions.items():
                self._last[(namespace, name, pool)] = d
                self._decisions.labels(namespace, name, pool, direction(d), d.reason).inc()
                for drains in self._drains.values():
                    # Exported at 0 from the first decision on: rate() and increase() need a
                    # sample before the first drain to count it.
                    drains.labels(namespace, name, pool)

    def record_step(self, namespace: str, name: str, pool: str, outcome: str) -> None:
        """A PoolScaler.step outcome; only the drain outcomes count."""
        if outcome in self._drains:
            self._drains[outcome].labels(namespace, name, pool).inc()

    def retain(self, alive: Iterable[tuple[str, str]]) -> None:
        """Drop the gauges of every InferenceDeployment not in `alive` (namespace, name)."""
        keep = set(alive)
        with self._lock:
            for key in [k for k in self._last if k[:2] not in keep]:
                del self._last[key]

    def _gauges(self) -> Iterable[Metric]:
        with self._lock:
            last = dict(self._last)
        desired = GaugeMetricFamily("kvmesh_autoscaler_desired_replicas",
                                    "Replicas the autoscaler's last decision asks for.", labels=LABELS)
        current = GaugeMetricFamily("kvmesh_autoscaler_current_replicas",
                                    "The pool's replicas when the autoscaler last decided.", labels=LABELS)
        slo = GaugeMetricFamily("kvmesh_autoscaler_slo_met",
                                "1 when the pool's TTFT/TPOT at the SLO percentile are within the SLO, "
                                "0 when not; absent without an SLO or latency data.", labels=LABELS)
        for key, d in sorted(last.items()):
            desired.add_metric(list(key), d.desired)
            current.add_metric(list(key), d.current)
            if d.slo_met is not None:
                slo.add_metric(list(key), 1.0 if d.slo_met else 0.0)
        return [desired, current, slo]

    def exposition(self) -> tuple[bytes, str]:
        """The metrics in the Prometheus text format, with its content type."""
        return render(self.registry)
