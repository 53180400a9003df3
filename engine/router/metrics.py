"""The router's Prometheus metrics (``kvmesh_router_*``), in its own registry.

Engine labels are engine base URLs: pods come and go, but a router sees at most a few hundred
over its life, and per-engine series are what tell a hot engine from a cold one.

A router serves one deployment and has no name for it: the end-to-end latency series carry no
deployment label, and the scrape's target labels (``namespace``/``pod``, and the chart's
``inference_deployment``/``component``) tell deployments apart.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from kvmesh.engine.router.slo import ClientClock
from kvmesh.engine.util.metrics import (
    EVENT_LOOP_LAG_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    ROUTER_TPOT,
    ROUTER_TTFT,
    STREAM_LABEL,
    TOKEN_LATENCY_BUCKETS,
    CallbackCollector,
    check_name,
    counter,
    gauge,
    gauge_family,
    histogram,
    new_registry,
)

OUTCOMES = ("ok", "client_error", "upstream_error", "failed_midstream", "aborted", "unavailable", "shed")
"""ok: 2xx; client_error: an upstream 4xx passed through; upstream_error: an upstream 5xx passed
through; failed_midstream: the engine died after the first byte; aborted: the client left;
unavailable: no engine could take the request (503 from the router); shed: every engine was at
--shed-above-running (429 from the router)."""

# Predicted minus reported cached tokens: symmetric, in tokens (one block is 16 by default).
CACHED_TOKENS_ERROR_BUCKETS: tuple[float, ...] = tuple(
    sorted({-x for x in (1, 16, 64, 256, 1024, 4096)} | {0} | {1, 16, 64, 256, 1024, 4096}))


class RouterMetrics:
    def __init__(self, policy: str, engines_healthy: Callable[[], int],
                 index_size: Callable[[], Mapping[str, Mapping[str, int]]],
                 mismatches: Callable[[], Mapping[str, str]] = dict,
                 rates: Callable[[], Mapping[str, tuple[float | None, float | None]]] = dict) -> None:
        self.policy = policy
        r = self.registry = new_registry()
        self.requests = counter(r, "kvmesh_router_requests_total",
                                "Requests by policy, engine and outcome (see OUTCOMES).",
                                ("policy", "engine", "outcome"))
        self.auth_refused = counter(r, "kvmesh_router_auth_refused_total",
                                    "Requests refused for a missing or wrong API key, by the access their "
                                    "endpoint needs and the status sent (401, 403).", ("access", "status"))
        self.retries = counter(r, "kvmesh_router_retries_total",
                               "Requests re-sent to another engine before any byte reached the client.",
                               ("reason",))
        self.decision = histogram(r, "kvmesh_router_decision_latency_seconds",
                                  "Time from a request's body to the chosen engine: tokenizing, hashing, "
                                  "index lookup and policy.", EVENT_LOOP_LAG_BUCKETS)
        self.ttft = histogram(r, "kvmesh_router_upstream_ttft_seconds",
                              "Time from sending a request upstream to its first response byte.",
                              REQUEST_LATENCY_BUCKETS)
        # What the client waits for, both stages of a P/D request included (engine/router/slo.py);
        # the engines' buckets, so the two compare bucket for bucket.
        self.e2e_ttft = histogram(r, ROUTER_TTFT,
                                  "End-to-end time to first token, per 200 response: from the router having the "
                                  "request to the first token event sent to the client (stream=\"true\"), or to "
                                  "the whole body when not streamed (stream=\"false\"). Per deployment by the "
                                  "scrape's pod labels.", REQUEST_LATENCY_BUCKETS, (STREAM_LABEL,))
        self.e2e_tpot = histogram(r, ROUTER_TPOT,
                                  "End-to-end time per output token of a streamed response that ended normally "
                                  "with 2 tokens or more: (last token event - first) / (tokens - 1), as sent to "
                                  "the client. Per deployment by the scrape's pod labels.", TOKEN_LATENCY_BUCKETS)
        # Both label values exist from the start, so rates over them are defined before the first request.
        self._ttft_by_stream = {True: self.e2e_ttft.labels("true"), False: self.e2e_ttft.labels("false")}
        self.cached_error = Histogram(
            check_name("kvmesh_router_cached_tokens_prediction_error"),
            "Predicted cached prompt tokens minus the engine's usage.prompt_tokens_details.cached_tokens "
            "(0: the router knew the engine's cache exactly).", buckets=CACHED_TOKENS_ERROR_BUCKETS, registry=r)
        self.ext_proc = gauge(r, "kvmesh_router_ext_proc_info",
                              "1 while the router serves Envoy's ext_proc (--ext-proc-port), labelled by who "
                              "carries the gRPC streams: front=\"compiled\" (the Go front) or \"python\" (grpc.aio).",
                              ("front",))
        self._engines_healthy = engines_healthy
        self._index_size = index_size
        self._mismatches = mismatches
        self._rates = rates
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
        bad = GaugeMetricFamily("kvmesh_router_engine_kv_mismatch",
                                "1 for an engine whose KV hash chain differs from the router's and the pool's "
                                "(field: hash_function, root_hash, block_size or extra_key): it is never "
                                "prefix-matched.", labels=["engine", "field"])
        for engine, name in self._mismatches().items():
            bad.add_metric([engine, name], 1)
        yield bad
        prefill = GaugeMetricFamily("kvmesh_router_engine_prefill_seconds_per_token",
                                    "Prefill seconds per uncached prompt token the router measured on the engine "
                                    "(its queue's drain rate; absent until measured), which the load score uses.",
                                    labels=["engine"])
        decode = GaugeMetricFamily("kvmesh_router_engine_decode_seconds_per_sequence",
                                   "Median decode step time over the last probe interval per running sequence "
                                   "(absent until measured), which the load score uses.", labels=["engine"])
        for engine, (spt, dec) in self._rates().items():
            if spt is not None:
                prefill.add_metric([engine], spt)
            if dec is not None:
                decode.add_metric([engine], dec)
        yield prefill
        yield decode

    def count_auth_refusal(self, access: str, status: int) -> None:
        self.auth_refused.labels(access, str(status)).inc()

    def count(self, engine: str, outcome: str) -> None:
        self.requests.labels(self.policy, engine, outcome).inc()

    def observe_client(self, clock: ClientClock) -> None:
        """Record one generation request's end-to-end TTFT/TPOT (once, when it is over)."""
        ttft = clock.ttft_s()
        if ttft is not None:
            self._ttft_by_stream[clock.stream].observe(ttft)
        tpot = clock.tpot_s()
        if tpot is not None:
            self.e2e_tpot.observe(tpot)


class PDMetrics:
    """The two-stage flow's metrics (``kvmesh_router_pd_*``), registered on the router's registry
    only when a prefill pool is configured, so a colocated router exposes none of them.

    Requests that complete are still counted by ``kvmesh_router_requests_total`` under the decode
    engine that answered; ``kvmesh_router_upstream_ttft_seconds`` then spans stage 1 and stage 2's
    first byte, and ``kvmesh_router_time_to_first_token_seconds`` everything the client waited for
    its first token (RouterMetrics, engine/router/slo.py).
    """

    def __init__(self, registry: CollectorRegistry, prefill_healthy: Callable[[], int],
                 queued: Callable[[], int], stage1_outcomes: Iterable[str], fallback_reasons: Iterable[str]) -> None:
        r = registry
        self.stage1 = histogram(r, "kvmesh_router_pd_stage1_seconds",
                                "Successful stage 1 as the router sees it: from the POST to a prefill engine to its "
                                "kv_transfer answer (its queue, the prefill and the KV transfer to the decode "
                                "engine).", REQUEST_LATENCY_BUCKETS)
        self.stage1_answers = counter(r, "kvmesh_router_pd_stage1_total",
                                      "Stage-1 answers by outcome: ok, decode_no_room, decode_failed, decode_refused, prefill_failed "
                                      "(connection error, 5xx or 429 from the prefill engine), relayed (4xx).",
                                      ("outcome",))
        self.refusals = counter(r, "kvmesh_router_pd_decode_refusals_total",
                                "Reservations a decode engine refused (decode_no_room), by decode engine.",
                                ("engine",))
        self.restarts = counter(r, "kvmesh_router_pd_restarts_total",
                                "Requests started over at stage 1 because stage 2 failed before its first byte, by "
                                "reason (transfer_not_found, connect, status, disconnect).", ("reason",))
        self.queue_wait = histogram(r, "kvmesh_router_pd_queue_wait_seconds",
                                    "Time requests waited because every decode engine refused them (observed when "
                                    "each leaves the wait: placed, rejected or gone).", REQUEST_LATENCY_BUCKETS)
        self.queue_rejected = counter(r, "kvmesh_router_pd_queue_rejected_total",
                                      "Requests answered 503 no_decode_capacity, by reason (timeout: "
                                      "--pd-queue-timeout passed; full: --pd-max-queued requests were waiting).",
                                      ("reason",))
        self.fallback = counter(r, "kvmesh_router_pd_fallback_total",
                                "Requests served plain by a decode engine instead of in two stages, by reason.",
                                ("reason",))
        self.blocks_sent = counter(r, "kvmesh_router_pd_blocks_sent_total",
                                   "KV blocks prefill engines sent to decode engines (from stage-1 answers).")
        self.decode_hit_blocks = counter(r, "kvmesh_router_pd_decode_hit_blocks_total",
                                         "Prompt blocks the chosen decode engine already held, so were not sent.")
        # Every label value exists from the start, so rates over them are defined before the first event.
        for outcome in stage1_outcomes:
            self.stage1_answers.labels(outcome)
        for reason in fallback_reasons:
            self.fallback.labels(reason)
        for reason in ("timeout", "full"):
            self.queue_rejected.labels(reason)
        self._prefill_healthy = prefill_healthy
        self._queued = queued
        r.register(CallbackCollector(self._collect))

    def _collect(self) -> Iterable[Metric]:
        yield gauge_family("kvmesh_router_prefill_engines_healthy", "Prefill engines that pass their readiness "
                           "probe.", self._prefill_healthy())
        yield gauge_family("kvmesh_router_pd_queued", "Requests waiting now because every decode engine refused "
                           "them.", self._queued())
