"""The engine server's metrics: kvmesh_* series plus the inference gateway's names.

Latency histograms are observed on the event loop when a request's outputs
arrive; engine gauges and cumulative counters are read at scrape time from the
last `EngineStats` snapshot the engine thread published (never from the engine
itself, which only its own thread touches).

The Gateway API Inference Extension model-server protocol reads waiting and
running request counts and KV cache utilization, plus optionally the block
size and block count; its endpoint picker looks for them under vLLM's names by
default, so we export those names too (`vllm:num_requests_waiting`,
`vllm:num_requests_running`, `vllm:kv_cache_usage_perc` with its older alias
`vllm:gpu_cache_usage_perc`, `vllm:cache_config_info` and `vllm:lora_requests_info`). As in
vLLM, the "perc" gauges hold a fraction in [0, 1]. `vllm:lora_requests_info` carries the adapter
lists as labels and, as its value, the time they last changed (the picker keeps the newest
series); kvmesh serves no LoRA adapters yet, so both lists are empty, `max_lora` is 0 and the
value is the time the model was loaded.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvmesh.engine.outputs import RequestOutput

if TYPE_CHECKING:  # the engine module pulls in torch; only its dataclass is needed here
    from kvmesh.engine.engine import EngineStats
    from kvmesh.engine.kv.tiers import TierSnapshot
from kvmesh.engine.util.metrics import (
    EVENT_LOOP_LAG_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TOKEN_LATENCY_BUCKETS,
    CallbackCollector,
    counter,
    counter_family,
    gauge_family,
    histogram,
    new_registry,
)

TIER_GPU = "gpu"  # device memory, whatever the device (the KV tier names are shared across roles)
_TIER_FAMILIES = {  # kvmesh_kv_tier_<name>: (kind, help)
    "capacity_blocks": ("gauge", "KV blocks the tier can hold (remote: 0, see the cache node's metrics)."),
    "used_blocks": ("gauge", "KV blocks the tier holds (gpu: in use by requests)."),
    "capacity_bytes": ("gauge", "KV bytes the tier can hold."),
    "used_bytes": ("gauge", "KV bytes the tier holds (gpu: in use by requests)."),
    "evictions": ("counter", "Cached blocks dropped from the tier to make room (gpu: moved to the host tier "
                             "when there is one)."),
    "promotions": ("counter", "Blocks loaded from the tier into the primary pool's prefix index."),
    "stored": ("counter", "Blocks written into the tier."),
    "dropped_saves": ("counter", "Blocks not saved into the tier (no room, busy or unreachable node)."),
    "failures": ("counter", "Tier transfers that failed (timeout, dead node, header mismatch): recomputed."),
}
# kvmesh_state_checkpoint_<name>: a hybrid model's recurrent-state checkpoints per medium, in
# checkpoints (fixed size each: capacity_bytes / capacity_entries). Rows come from the same
# snapshots as the KV tiers', renamed by _STATE_NAMES.
_STATE_FAMILIES = {
    "capacity_entries": ("gauge", "Checkpoints the medium can hold (remote: 0, see the cache node's metrics)."),
    "used_entries": ("gauge", "Checkpoints the medium holds (gpu: published, reusable by a prefix hit)."),
    "capacity_bytes": ("gauge", "Checkpoint bytes the medium can hold."),
    "used_bytes": ("gauge", "Checkpoint bytes the medium holds."),
    "stored": ("counter", "Checkpoints written into the medium (gpu: captured at block boundaries)."),
    "evictions": ("counter", "Checkpoints dropped from the medium to make room (gpu: moved to the host "
                             "tier when there is one)."),
    "restores": ("counter", "Prefix hits served from the medium (gpu: restored into a request's state slot; "
                            "cpu, remote: promoted into the device pool)."),
    "dropped_saves": ("counter", "Checkpoints not saved into the medium (no free entry, busy or unreachable node)."),
    "failures": ("counter", "Checkpoint transfers that failed (timeout, dead node, layout mismatch): recomputed."),
}
_STATE_NAMES = {"capacity_blocks": "capacity_entries", "used_blocks": "used_entries", "promotions": "restores"}


def _tier_row(t: "TierSnapshot") -> dict[str, int]:
    st = t.stats
    return {"capacity_blocks": t.capacity_blocks, "used_blocks": t.used_blocks,
            "capacity_bytes": t.capacity_blocks * t.block_bytes, "used_bytes": t.used_blocks * t.block_bytes,
            "evictions": st.evictions, "promotions": st.promotions, "stored": st.stored,
            "dropped_saves": st.dropped, "failures": st.failures}


class ServerMetrics:
    """Metrics of one engine server. `stats` returns the latest engine snapshot or None before the first."""

    def __init__(self, model_name: str, block_size: int, stats: Callable[[], "EngineStats | None"],
                 ready: Callable[[], bool], registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or new_registry()
        self.model_name = model_name
        self.block_size = block_size
        self._stats = stats
        self._ready = ready
        lbl = ("model_name",)
        r = self.registry
        self._hist_ttft = histogram(r, "kvmesh_time_to_first_token_seconds",
                                    "Time from request arrival to its first output token.",
                                    REQUEST_LATENCY_BUCKETS, lbl)
        self._hist_itl = histogram(r, "kvmesh_inter_token_latency_seconds",
                                   "Time between consecutive output tokens of a request (per token).",
                                   TOKEN_LATENCY_BUCKETS, lbl)
        self._hist_tpot = histogram(r, "kvmesh_time_per_output_token_seconds",
                                    "Mean time per output token after the first, per finished request.",
                                    TOKEN_LATENCY_BUCKETS, lbl)
        self._hist_e2e = histogram(r, "kvmesh_e2e_request_latency_seconds",
                                   "Time from request arrival to its last token.",
                                   REQUEST_LATENCY_BUCKETS, lbl)
        self._hist_queue = histogram(r, "kvmesh_request_queue_time_seconds",
                                     "Time from request arrival to its first scheduling.",
                                     REQUEST_LATENCY_BUCKETS, lbl)
        # No model label: it measures this process's event loop, whatever it serves.
        self._loop_lag = histogram(r, "kvmesh_event_loop_lag_seconds",
                                   "Time from the end of an engine step until the event loop dispatches "
                                   "its outputs (stays small while the server keeps up with the engine).",
                                   EVENT_LOOP_LAG_BUCKETS)
        self.set_model(model_name, block_size)
        self._finished = counter(r, "kvmesh_requests_finished_total",
                                 "Engine sequences finished, by finish reason (stop, length, abort).",
                                 ("model_name", "finish_reason"))
        self._errors = counter(r, "kvmesh_request_errors_total",
                               "API requests answered with an error, by error code.",
                               ("model_name", "code"))
        self._handoffs = counter(r, "kvmesh_kv_handoffs_total",
                                 "Prefill role: KV handoffs to decode engines, by outcome (ok, decode_no_room, "
                                 "decode_unreachable, decode_failed, ...).", ("model_name", "outcome"))
        self._handoff_bytes = counter(r, "kvmesh_kv_handoff_bytes_total",
                                      "Prefill role: KV bytes pushed to decode engines.", lbl)
        self._hist_handoff = histogram(r, "kvmesh_kv_handoff_seconds",
                                       "Prefill role: time to push one request's KV and first token to its "
                                       "decode engine (after the prefill).", REQUEST_LATENCY_BUCKETS, lbl)
        self.transfer_auth_failures: Callable[[], int] = lambda: 0  # set by the server (its decode endpoint)
        self.transfer_header_mismatches: Callable[[], int] = lambda: 0  # set by the server (its decode endpoint)
        self._auth_refused = counter(r, "kvmesh_auth_refused_total",
                                     "Requests refused for a missing or wrong credential, by the access their "
                                     "endpoint needs (client, internal) and the status sent (401, 403).",
                                     ("access", "status"))
        r.register(CallbackCollector(self._engine_families))

    def set_model(self, model_name: str, block_size: int, dtype: str = "", dtype_source: str = "",
                  device: str = "") -> None:
        """Bind the label values (known once the model is loaded; nothing is observed before).
        ``dtype``/``dtype_source``/``device`` label ``kvmesh_engine_info``: the compute dtype and
        whether ``--dtype`` set it ("flag") or ``auto`` chose it for the device ("auto")."""
        self.model_name = model_name
        self.block_size = block_size
        self._info = {"model_name": model_name, "dtype": dtype, "dtype_source": dtype_source, "device": device}
        self._adapters_changed_at = time.time()  # wall clock: the picker compares it across series
        if not model_name:
            return  # no empty-labelled histogram series while the model loads
        self._ttft = self._hist_ttft.labels(model_name)
        self._itl = self._hist_itl.labels(model_name)
        self._tpot = self._hist_tpot.labels(model_name)
        self._e2e = self._hist_e2e.labels(model_name)
        self._queue = self._hist_queue.labels(model_name)

    # ---- observations (event loop) --------------------------------------------
    def observe_finished(self, out: RequestOutput) -> None:
        """Count a finished sequence; record its latencies unless it was aborted."""
        self._finished.labels(self.model_name, out.finish_reason or "unknown").inc()
        if out.finish_reason == "abort":
            return
        m = out.metrics
        if m.first_scheduled_time is not None:
            self._queue.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        if m.first_token_time is not None:
            self._ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
        end = m.finished_time or m.last_token_time
        if end is not None:
            self._e2e.observe(max(0.0, end - m.arrival_time))
        n = out.num_output_tokens
        if n > 1 and m.first_token_time is not None and m.last_token_time is not None:
            self._tpot.observe(max(0.0, (m.last_token_time - m.first_token_time) / (n - 1)))

    def observe_token_gap(self, seconds: float, num_tokens: int) -> None:
        """`num_tokens` tokens arrived `seconds` after the previous token of the same request."""
        if num_tokens > 0:
            per = max(0.0, seconds) / num_tokens
            for _ in range(num_tokens):
                self._itl.observe(per)

    def observe_dispatch_lag(self, seconds: float) -> None:
        self._loop_lag.observe(max(0.0, seconds))

    def observe_handoff(self, outcome: str, nbytes: int = 0, seconds: float | None = None) -> None:
        self._handoffs.labels(self.model_name, outcome).inc()
        if nbytes:
            self._handoff_bytes.labels(self.model_name).inc(nbytes)
        if seconds is not None:
            self._hist_handoff.labels(self.model_name).observe(max(0.0, seconds))

    def count_error(self, code: str) -> None:
        self._errors.labels(self.model_name, code).inc()

    def count_auth_refusal(self, access: str, status: int) -> None:
        self._auth_refused.labels(access, str(status)).inc()

    # ---- scrape-time families ---------------------------------------------------
    def _tier_families(self, s: "EngineStats") -> Iterator[Metric]:
        """kvmesh_kv_tier_* per KV tier: the primary pool (gpu) and the tiers below it (cpu, remote);
        kvmesh_state_checkpoint_* per medium holding a hybrid model's checkpoints (gpu, cpu, remote).

        The remote tier's capacity lives on the cache node (its kvmesh_cachenode_* metrics), so the
        engine reports 0 there. Queries and hits of lower KV tiers are rows of
        kvmesh_prefix_cache_{queries,hits}_total (see _engine_families).
        """
        block_bytes = getattr(s, "kv_block_bytes", 0)
        used = s.num_kv_blocks - s.num_free_blocks
        rows = {TIER_GPU: {"capacity_blocks": s.num_kv_blocks, "used_blocks": used,
                           "capacity_bytes": s.num_kv_blocks * block_bytes, "used_bytes": used * block_bytes,
                           "evictions": getattr(s, "kv_evictions", 0)}}
        rows.update((t.tier, _tier_row(t)) for t in getattr(s, "tiers", ()))
        yield from self._per_tier("kvmesh_kv_tier_", _TIER_FAMILIES, rows)
        states = {t.tier: _tier_row(t) for t in getattr(s, "state_tiers", ())}
        if states:
            renamed = {tier: {_STATE_NAMES.get(k, k): v for k, v in row.items()} for tier, row in states.items()}
            yield from self._per_tier("kvmesh_state_checkpoint_", _STATE_FAMILIES, renamed)

    def _per_tier(self, prefix: str, families: dict[str, tuple[str, str]],
                  rows: dict[str, dict[str, int]]) -> Iterator[Metric]:
        for name, (kind, doc) in families.items():
            cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            fam = cls(f"{prefix}{name}", doc, labels=["model_name", "tier"])
            for tier, values in rows.items():
                if name in values:
                    fam.add_metric([self.model_name, tier], float(values[name]))
            yield fam

    def _engine_families(self) -> Iterator[Metric]:
        model = {"model_name": self.model_name}
        tier = {"model_name": self.model_name, "tier": TIER_GPU}
        yield gauge_family("kvmesh_server_ready", "1 when the server accepts requests, 0 while loading "
                           "or draining.", 1.0 if self._ready() else 0.0, model)
        s = self._stats()
        if s is None:
            return
        yield counter_family("kvmesh_kv_transfer_auth_failures_total", "Decode role: KV transfer connections "
                             "closed for not proving the internal token.", self.transfer_auth_failures())
        yield counter_family("kvmesh_kv_transfer_header_mismatches_total", "Decode role: KV transfer "
                             "reservations refused because their KV or recurrent-state layout differs from this "
                             "engine's (the prefill side falls back to another decode engine).",
                             self.transfer_header_mismatches())
        if self._info.get("dtype"):
            yield gauge_family("kvmesh_engine_info", "1, labelled with the engine's compute dtype, how it was "
                               "chosen (flag or auto) and its device.", 1.0, self._info)
        yield gauge_family("kvmesh_num_requests_running", "Sequences in the running batch.", s.num_running, model)
        yield gauge_family("kvmesh_num_requests_waiting", "Sequences waiting to be scheduled.",
                           s.num_waiting, model)
        yield gauge_family("kvmesh_queued_prefill_tokens", "Prompt tokens admitted but not yet computed "
                           "(waiting and partly prefilled requests).",
                           s.queued_prefill_tokens, model)
        yield gauge_family("kvmesh_kv_cache_usage_ratio", "Fraction of KV blocks in use (0..1).", s.kv_usage, tier)
        yield gauge_family("kvmesh_kv_cache_blocks", "KV blocks in the pool.", s.num_kv_blocks, tier)
        yield gauge_family("kvmesh_kv_cache_free_blocks", "KV blocks not held by any request "
                           "(cached or empty).", s.num_free_blocks, tier)
        yield counter_family("kvmesh_prompt_tokens_total", "Prompt tokens admitted.", s.prompt_tokens, model)
        yield counter_family("kvmesh_generation_tokens_total", "Tokens generated.", s.generation_tokens, model)
        lower = getattr(s, "tiers", ())
        for name, doc, gpu_value, attr in (
                ("kvmesh_prefix_cache_queries", "Prompt tokens looked up in the prefix cache (per tier: "
                 "the tokens the tiers above it missed).", s.prefix_queries, "queries"),
                ("kvmesh_prefix_cache_hits", "Prompt tokens served from the prefix cache (per tier).",
                 s.prefix_hits, "hits")):
            fam = CounterMetricFamily(name, doc, labels=["model_name", "tier"])
            fam.add_metric([self.model_name, TIER_GPU], float(gpu_value))
            for t in lower:
                fam.add_metric([self.model_name, t.tier], float(getattr(t.stats, attr)))
            yield fam
        yield counter_family("kvmesh_preemptions_total", "Sequences preempted (recomputed later) for lack "
                             "of KV blocks.", s.num_preemptions, model)
        yield from self._tier_families(s)
        yield gauge_family("kvmesh_kv_transfers_reserved", "Decode role: KV transfers reserved or received and "
                           "not yet claimed by their request.", getattr(s, "kv_transfers_reserved", 0), model)
        yield gauge_family("kvmesh_kv_transfer_reserved_blocks", "Decode role: KV blocks those transfers hold.",
                           getattr(s, "kv_transfer_blocks_reserved", 0), tier)
        yield gauge_family("kvmesh_kv_handoffs_held", "Prefill role: requests whose blocks wait for their "
                           "consumers (decode engine, cache node) to confirm.", getattr(s, "kv_handoffs_held", 0),
                           model)
        yield counter_family("kvmesh_kv_transfer_timeouts_total", "Handoffs whose blocks were freed by timeout "
                             "(reservations never filled or claimed; held blocks never confirmed).",
                             getattr(s, "kv_transfer_timeouts", 0), model)
        # Gateway API Inference Extension model-server protocol (vLLM's names).
        yield gauge_family("vllm:num_requests_waiting", "TotalQueuedRequests: requests waiting to be scheduled.",
                           s.num_waiting, model)
        yield gauge_family("vllm:num_requests_running", "TotalRunningRequests: requests being served.",
                           s.num_running, model)
        yield gauge_family("vllm:kv_cache_usage_perc", "KVCacheUtilization: fraction of KV cache in use (0..1).",
                           s.kv_usage, model)
        yield gauge_family("vllm:gpu_cache_usage_perc", "KVCacheUtilization under its older name (0..1).",
                           s.kv_usage, model)
        yield gauge_family("vllm:cache_config_info", "KV cache geometry (BlockSize, NumGPUBlocks) as labels.", 1.0,
                           {"model_name": self.model_name, "block_size": str(self.block_size),
                            "num_gpu_blocks": str(s.num_kv_blocks)})
        yield gauge_family("vllm:lora_requests_info", "LoRA adapters loaded (running_lora_adapters) and waited "
                           "for (waiting_lora_adapters), comma-separated, as labels; the value is the time "
                           "they last changed (seconds since the epoch).", self._adapters_changed_at,
                           {"model_name": self.model_name, "max_lora": "0", "running_lora_adapters": "",
                            "waiting_lora_adapters": ""})
