"""The router's Prometheus metrics (``kvmesh_router_*``), in its own registry.

Engine labels are engine base URLs: pods come and go, but a router sees at most a few hundred
over its life, and per-engine series are what tell a hot engine from a cold one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from prometheus_client import Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from kvmesh.engine.server.metrics_util import (
    EVENT_LOOP_LAG_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    CallbackCollector,
    check_name,
    counter,
    gauge_family,
    histogram,
    new_registry,
)

OUTCOMES = ("ok", "client_error", "upstream_error", "failed_midstream", "aborted", "unavailable")
"""ok: 2xx; client_error: an upstream 4xx passed through; upstream_error: an upstream 5xx passed
through; failed_midstream: the engine died after the first byte; aborted: the client left;
unavailable: no engine could take the request (503 from the router)."""

# Predicted minus reported cached tokens: symmetric, in tokens (one block is 16 by default).
CACHED_TOKENS_ERROR_BUCKETS: tuple[float, ...] = tuple(
    sorted({-x for x in (1, 16, 64, 256, 1024, 4096)} | {0} | {1, 16, 64, 256, 1024, 4096}))


class RouterMetrics:
    def __init__(self, policy: str, engines_healthy: Callable[[], int],
                 index_size: Callable[[], Mapping[str, Mapping[str, int]]]) -> None:
        self.policy = policy
        r = self.registry = new_registry()
        self.requests = counter(r, "kvmesh_router_requests_total",
                                "Requests by policy, engine and outcome (see OUTCOMES).",
                                ("policy", "engine", "outcome"))
        self.retries = counter(r, "kvmesh_router_retries_total",
                               "Requests re-sent to another engine before any byte reached the client.",
                               ("reason",))
        self.decision = histogram(r, "kvmesh_router_decision_latency_seconds",
                                  "Time from a request's body to the chosen engine: tokenizing, hashing, "
                                  "index lookup and policy.", EVENT_LOOP_LAG_BUCKETS)
        self.ttft = histogram(r, "kvmesh_router_upstream_ttft_seconds",
                              "Time from sending a request upstream to its first response byte.",
                              REQUEST_LATENCY_BUCKETS)
        self.cached_error = Histogram(
            check_name("kvmesh_router_cached_tokens_prediction_error"),
            "Predicted cached prompt tokens minus the engine's usage.prompt_tokens_details.cached_tokens "
            "(0: the router knew the engine's cache exactly).", buckets=CACHED_TOKENS_ERROR_BUCKETS, registry=r)
        self._engines_healthy = engines_healthy
        self._index_size = index_size
        r.register(CallbackCollector(self._collect))

    def _collect(self) -> Iterable[Metric]:
        yield gauge_family("kvmesh_router_engines_healthy", "Engines that pass their readiness probe.",
                           self._engines_healthy())
        fam = GaugeMetricFamily("kvmesh_router_index_blocks", "Block hashes in the prefix index.",
                                labels=["engine", "tier"])
        for engine, tiers in self._index_size().items():
            for tier, n in tiers.items():
                fam.add_metric([engine, tier], n)
        yield fam

    def count(self, engine: str, outcome: str) -> None:
        self.requests.labels(self.policy, engine, outcome).inc()
