"""The SLO dashboard of one InferenceDeployment: panels as data, every PromQL expression here.

Series are selected by the labels the chart's PodMonitors attach (templates/podmonitor.yaml):
`namespace` and `pod` (added by the Prometheus Operator), plus `inference_deployment` and
`component` relabeled from the pod labels the operator renders (render.OWNER_LABEL and
app.kubernetes.io/component). Grafana's template variables pick the namespace and deployment;
`substitute` fills them in the same way for the tests and for `kvmesh dashboard snapshot`.

The SLO thresholds are template variables whose options are the latency histograms' bucket
bounds, spelled as the exposition spells `le`: attainment is the share of observations at or
below the SLO, and a classic histogram knows that exactly only at a bucket bound.

TTFT and TPOT are shown twice: per pool as each engine measures it, and end to end as the router
measures it (engine/router/slo.py: from the router having the request to the tokens it sends,
both stages of a disaggregated request included). For a disaggregated deployment the end-to-end
series is the one that matters (a decode engine's TTFT starts at stage 2, near zero) and the
one the autoscaler scales on (metrics_source.latency_histograms); colocated, the two agree within
the routing time. The router's TTFT series is its streamed requests' (`stream="true"`): a body
that is not streamed is the whole response, no first-token time.

The autoscaler's panels read the operator's own metrics (operator/metrics.py), which carry the
same namespace / inference_deployment / component labels as exported (the chart's operator
PodMonitor honors them).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.utils import floatToGoString

from kvmesh.engine.util.metrics import (
    REQUEST_LATENCY_BUCKETS,
    ROUTER_TPOT,
    ROUTER_TTFT,
    STREAM_LABEL,
    TOKEN_LATENCY_BUCKETS,
)

DEPLOYMENT_LABEL = "inference_deployment"
COMPONENT_LABEL = "component"
UID = "kvmesh-slo"
FILE_NAME = f"{UID}.json"
RATE = "$__rate_interval"

_POOL = f'namespace="$namespace",{DEPLOYMENT_LABEL}="$deployment"'
ENGINES = f'{_POOL},{COMPONENT_LABEL}=~"prefill|decode"'
ROUTER = f'{_POOL},{COMPONENT_LABEL}="router"'
CACHE = f'{_POOL},{COMPONENT_LABEL}="cache"'
ROUTER_STREAMED = f'{ROUTER},{STREAM_LABEL}="true"'  # first-token times (module doc)

TTFT = "kvmesh_time_to_first_token_seconds"
TPOT = "kvmesh_time_per_output_token_seconds"


def le_values(buckets: tuple[float, ...]) -> tuple[str, ...]:
    """Bucket bounds as prometheus_client writes them into `le` (e.g. 1.0 -> "1.0")."""
    return tuple(floatToGoString(b) for b in buckets)


# ---- PromQL building blocks -----------------------------------------------------------------
def rate(series: str, sel: str) -> str:
    return f"rate({series}{{{sel}}}[{RATE}])"


def quantile(hist: str, sel: str, by: str = "") -> str:
    keys = f"{by}, le" if by else "le"
    return f"histogram_quantile($percentile, sum by ({keys}) ({rate(hist + '_bucket', sel)}))"


def within_slo(hist: str, slo_var: str) -> str:
    """Observations per second at or below the SLO, per pool."""
    sel = f'{ENGINES},le="${slo_var}"'
    return f"sum by (component) ({rate(hist + '_bucket', sel)})"


def observed(hist: str) -> str:
    return f"sum by (component) ({rate(hist + '_count', ENGINES)})"


def attainment(hist: str, slo_var: str) -> str:
    return f"{within_slo(hist, slo_var)} / {observed(hist)}"


def router_attainment(hist: str, sel: str, slo_var: str) -> str:
    """Share of the router's end-to-end observations at or below the SLO."""
    within = f'{sel},le="${slo_var}"'
    return f"sum({rate(hist + '_bucket', within)}) / sum({rate(hist + '_count', sel)})"


# A request meets both SLOs unless it misses TTFT or misses TPOT, so the rate of requests within
# both is at least (within TTFT) - (missed TPOT). The histograms are separate, so this lower
# bound is the most they tell (a TPOT exists only for requests of two tokens or more).
GOODPUT_LOWER_BOUND = (f"clamp_min({within_slo(TTFT, 'ttft_slo')} - "
                       f"({observed(TPOT)} - {within_slo(TPOT, 'tpot_slo')}), 0)")

# Engines report their device tier as kvmesh_kv_cache_usage_ratio; tiers below it (host memory)
# as kvmesh_kv_tier_* blocks, whose remote row has no capacity (the cache nodes hold it: their
# own series below). `or` keeps the first form where both exist.
KV_OCCUPANCY_ENGINE = (
    f"avg by (component, tier) (kvmesh_kv_cache_usage_ratio{{{ENGINES}}}) or "
    f'sum by (component, tier) (kvmesh_kv_tier_used_blocks{{{ENGINES},tier!="gpu"}}) / '
    f'(sum by (component, tier) (kvmesh_kv_tier_capacity_blocks{{{ENGINES},tier!="gpu"}}) > 0)')
KV_OCCUPANCY_CACHE = (f"sum(kvmesh_cachenode_used_bytes{{{CACHE}}}) / "
                      f"(sum(kvmesh_cachenode_capacity_bytes{{{CACHE}}}) > 0)")
PREFIX_HIT_RATE = (f"sum by (tier) ({rate('kvmesh_prefix_cache_hits_total', ENGINES)}) / "
                   f"(sum by (tier) ({rate('kvmesh_prefix_cache_queries_total', ENGINES)}) > 0)")


# ---- panels ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Query:
    expr: str
    legend: str
    slo: bool = False  # a threshold drawn as a dashed line, not a measurement


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    queries: tuple[Query, ...]
    description: str = ""
    slo_panel: bool = False  # one of the panels `kvmesh dashboard snapshot` renders
    text: str = ""  # a text panel (no queries) when set


PANELS: tuple[Panel, ...] = (
    Panel("TTFT at the SLO percentile", "s", (
        Query(quantile(ROUTER_TTFT, ROUTER_STREAMED), "end to end (router)"),
        Query(quantile(TTFT, ENGINES, "component"), "{{component}}"),
        Query(quantile("kvmesh_router_upstream_ttft_seconds", ROUTER), "router (first byte upstream)"),
        Query("vector($ttft_slo)", "SLO", slo=True)),
        "Time to first token at the percentile the SLO names: end to end as the client gets it "
        "(streamed requests; both stages of a disaggregated one: what its prefill pool scales on), and "
        "per pool as each engine measures it (a disaggregated decode engine's starts at stage 2).",
        slo_panel=True),
    Panel("TPOT at the SLO percentile", "s", (
        Query(quantile(ROUTER_TPOT, ROUTER), "end to end (router)"),
        Query(quantile(TPOT, ENGINES, "component"), "{{component}}"),
        Query("vector($tpot_slo)", "SLO", slo=True)),
        "Mean time per output token after the first, per finished request: end to end as the client "
        "gets it (streamed requests: what a disaggregated decode pool scales on), and per pool.",
        slo_panel=True),
    Panel("SLO attainment", "percentunit", (
        Query(router_attainment(ROUTER_TTFT, ROUTER_STREAMED, "ttft_slo"), "TTFT end to end (router)"),
        Query(router_attainment(ROUTER_TPOT, ROUTER, "tpot_slo"), "TPOT end to end (router)"),
        Query(attainment(TTFT, "ttft_slo"), "TTFT {{component}}"),
        Query(attainment(TPOT, "tpot_slo"), "TPOT {{component}}"),
        Query("vector($percentile)", "target", slo=True)),
        "Share of requests within the SLO; the SLO holds while this stays above the target.",
        slo_panel=True),
    Panel("Goodput", "reqps", (
        Query(observed(TTFT), "served {{component}}"),
        Query(GOODPUT_LOWER_BOUND, "within both SLOs (lower bound) {{component}}")),
        "Requests per second, and those within both the TTFT and the TPOT SLO.", slo_panel=True),
    Panel("Request rate", "reqps", (
        Query(f"sum by (outcome) ({rate('kvmesh_router_requests_total', ROUTER)})", "router {{outcome}}"),
        Query(f"sum by (component, finish_reason) ({rate('kvmesh_requests_finished_total', ENGINES)})",
              "{{component}} {{finish_reason}}")),
        "Router requests by outcome; engine sequences by finish reason.", slo_panel=True),
    Panel("Running and waiting requests", "short", (
        Query(f"sum by (component) (kvmesh_num_requests_running{{{ENGINES}}})", "running {{component}}"),
        Query(f"sum by (component) (kvmesh_num_requests_waiting{{{ENGINES}}})", "waiting {{component}}")),
        slo_panel=True),
    Panel("Queued prefill tokens", "short", (
        Query(f"sum by (component) (kvmesh_queued_prefill_tokens{{{ENGINES}}})", "{{component}}"),),
        "Prompt tokens admitted but not yet computed: the prefill pools' scaling signal."),
    Panel("KV occupancy per tier", "percentunit", (
        Query(KV_OCCUPANCY_ENGINE, "{{component}} {{tier}}"),
        Query(KV_OCCUPANCY_CACHE, "remote (cache nodes)")),
        "Fraction of each KV tier in use; decode pools scale on the device tier.", slo_panel=True),
    Panel("Prefix cache hit rate per tier", "percentunit", (
        Query(PREFIX_HIT_RATE, "{{tier}}"),),
        "Prompt tokens served from each tier over those looked up in it.", slo_panel=True),
    Panel("Preemptions", "ops", (
        Query(f"sum by (component) ({rate('kvmesh_preemptions_total', ENGINES)})", "{{component}}"),),
        "Sequences preempted for lack of KV blocks, per second."),
    Panel("Cache node transferred bytes", "Bps", (
        Query(f"sum by (pod) ({rate('kvmesh_cachenode_received_bytes_total', CACHE)})", "in {{pod}}"),
        Query(f"sum by (pod) ({rate('kvmesh_cachenode_sent_bytes_total', CACHE)})", "out {{pod}}")),
        "KV bytes stored into (puts) and served from (gets) the cache nodes."),
    Panel("Router decisions per engine", "reqps", (
        Query(f"sum by (engine) ({rate('kvmesh_router_requests_total', ROUTER)})", "{{engine}}"),),
        "Where the router sends requests."),
    Panel("Router retries and decision latency", "short", (
        Query(f"sum by (reason) ({rate('kvmesh_router_retries_total', ROUTER)})", "retries/s {{reason}}"),
        Query(quantile("kvmesh_router_decision_latency_seconds", ROUTER), "decision latency (s)")),
        "Requests re-sent to another engine before any byte reached the client; time to choose."),
    Panel("Pods per pool", "short", (
        Query(f"count by (component) (up{{{_POOL}}} == 1)", "scraped {{component}}"),
        Query(f"sum by (component) (kvmesh_server_ready{{{ENGINES}}})", "ready {{component}}"),
        Query(f"max(kvmesh_router_engines_healthy{{{ROUTER}}})", "healthy engines (router's view)")),
        "Current replicas as Prometheus sees them."),
    Panel("Replicas desired vs current", "short", (
        Query(f"max by (component) (kvmesh_autoscaler_desired_replicas{{{_POOL}}})", "desired {{component}}"),
        Query(f"max by (component) (kvmesh_autoscaler_current_replicas{{{_POOL}}})", "current {{component}}"),
        Query(f"min by (component) (kvmesh_autoscaler_slo_met{{{_POOL}}})", "SLO met {{component}}")),
        "The autoscaler's last decision per pool (from the operator's /metrics), and whether the "
        "pool met its SLO (1) or not (0)."),
    Panel("Autoscaler decisions by reason", "short", (
        Query(f"sum by (component, direction, reason) "
              f"(increase(kvmesh_autoscaler_decisions_total{{{_POOL}}}[{RATE}]))",
              "{{component}} {{direction}} {{reason}}"),
        Query(f"sum by (component) (increase(kvmesh_autoscaler_drains_started_total{{{_POOL}}}[{RATE}]))",
              "drains started {{component}}"),
        Query(f"sum by (component) "
              f"(increase(kvmesh_autoscaler_drains_timed_out_total{{{_POOL}}}[{RATE}]))",
              "drains timed out {{component}}")),
        "Decisions per interval by direction (up, down, hold) and reason; drains before "
        "scale-downs, and those that ran out of time. The last decision's message is in the "
        "InferenceDeployment's status.autoscaling, each action an Event on it."),
)


# ---- template variables ---------------------------------------------------------------------
@dataclass(frozen=True)
class Variable:
    name: str
    label: str
    options: tuple[str, ...] = ()  # a custom variable's choices; empty: a label_values query
    default: str = ""
    query: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)


VARIABLES: tuple[Variable, ...] = (
    Variable("namespace", "Namespace", query=f'label_values(up{{{DEPLOYMENT_LABEL}!=""}}, namespace)'),
    Variable("deployment", "InferenceDeployment",
             query=f'label_values(up{{namespace="$namespace",{DEPLOYMENT_LABEL}!=""}}, {DEPLOYMENT_LABEL})'),
    Variable("percentile", "SLO percentile", ("0.5", "0.9", "0.95", "0.99"), "0.95"),
    Variable("ttft_slo", "TTFT SLO (s)", le_values(REQUEST_LATENCY_BUCKETS), "1.0"),
    Variable("tpot_slo", "TPOT SLO (s)", le_values(TOKEN_LATENCY_BUCKETS), "0.05"),
)


def substitute(expr: str, values: Mapping[str, str]) -> str:
    """`expr` with Grafana's $name and ${name} replaced from `values` (KeyError if one is missing)."""
    def one(m: re.Match[str]) -> str:
        return values[m.group(1) or m.group(2)]
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, expr)


def default_values(namespace: str, deployment: str, rate_interval: str = "1m") -> dict[str, str]:
    """Every variable at its default, as a Grafana user first sees the dashboard."""
    out = {v.name: v.default for v in VARIABLES if v.options}
    out.update(namespace=namespace, deployment=deployment, __rate_interval=rate_interval)
    return out


def legend(fmt: str, labels: Mapping[str, str]) -> str:
    """A legend format with Grafana's {{label}} filled in."""
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip()


# ---- Grafana JSON ---------------------------------------------------------------------------
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
_WIDTH, _HEIGHT = 12, 8  # two panels a row on Grafana's 24-column grid
_SLO_STYLE = [  # thresholds drawn as dashed red lines, never stacked or filled
    {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
    {"id": "color", "value": {"mode": "fixed", "fixedColor": "red"}},
    {"id": "custom.fillOpacity", "value": 0},
]


def _variable_json(v: Variable) -> dict[str, Any]:
    if not v.options:
        return {"name": v.name, "label": v.label, "type": "query", "datasource": DATASOURCE,
                "query": {"query": v.query, "refId": v.name}, "definition": v.query,
                "refresh": 2, "sort": 1, "includeAll": False, "multi": False}
    return {"name": v.name, "label": v.label, "type": "custom", "query": ",".join(v.options),
            "current": {"text": v.default, "value": v.default, "selected": True},
            "options": [{"text": o, "value": o, "selected": o == v.default} for o in v.options],
            "includeAll": False, "multi": False}


def _panel_json(i: int, p: Panel) -> dict[str, Any]:
    pos = {"x": (i % 2) * _WIDTH, "y": (i // 2) * _HEIGHT, "w": _WIDTH, "h": _HEIGHT}
    if p.text:
        return {"id": i + 1, "type": "text", "title": p.title, "gridPos": pos,
                "options": {"mode": "markdown", "content": p.text}}
    targets = [{"refId": chr(ord("A") + j), "datasource": DATASOURCE, "expr": q.expr,
                "legendFormat": q.legend, "range": True} for j, q in enumerate(p.queries)]
    overrides = [{"matcher": {"id": "byName", "options": q.legend}, "properties": _SLO_STYLE}
                 for q in p.queries if q.slo]
    return {"id": i + 1, "type": "timeseries", "title": p.title, "description": p.description,
            "gridPos": pos, "datasource": DATASOURCE, "targets": targets,
            "fieldConfig": {"defaults": {"unit": p.unit or "short",
                                         "custom": {"lineWidth": 1, "fillOpacity": 0}},
                            "overrides": overrides},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "desc"}}}


def dashboard() -> dict[str, Any]:
    """The Grafana dashboard model (what the JSON file holds)."""
    datasource = {"name": "datasource", "label": "Data source", "type": "datasource",
                  "query": "prometheus"}
    return {
        "uid": UID,
        "title": "kvmesh SLO",
        "description": "SLO view of one InferenceDeployment (generated by kvmesh.operator.dashboards).",
        "tags": ["kvmesh"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [datasource] + [_variable_json(v) for v in VARIABLES]},
        "panels": [_panel_json(i, p) for i, p in enumerate(PANELS)],
    }


def render_files() -> dict[str, str]:
    """File name -> content of every generated dashboard."""
    return {FILE_NAME: json.dumps(dashboard(), indent=2) + "\n"}


def write_files(out: Path) -> list[Path]:
    """Write the dashboards into `out` and delete any other *.json there (a renamed or dropped one)."""
    out.mkdir(parents=True, exist_ok=True)
    files = render_files()
    for stale in out.glob("*.json"):
        if stale.name not in files:
            stale.unlink()
    written = []
    for name, text in files.items():
        (out / name).write_text(text)
        written.append(out / name)
    return written
