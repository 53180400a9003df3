"""The dashboard generator: committed JSON equals its output, queries and variables are
well-formed, and the chart's PodMonitor relabeling produces the labels the queries select on."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from kvmesh.cli import main
from kvmesh.engine.util.metrics import REQUEST_LATENCY_BUCKETS, TOKEN_LATENCY_BUCKETS
from kvmesh.operator import dashboards as d
from kvmesh.operator.render import OWNER_LABEL

ROOT = Path(__file__).resolve().parents[2]
GENERATED_DIRS = (ROOT / "dashboards", ROOT / "charts" / "kvmesh" / "dashboards")


@pytest.mark.parametrize("where", GENERATED_DIRS, ids=lambda p: str(p.relative_to(ROOT)))
def test_committed_json_is_the_generators_output(where):
    on_disk = {p.name: p.read_text() for p in where.glob("*.json")}
    assert on_disk == d.render_files(), (
        f"{where} is stale: run `kvmesh dashboard generate --out dashboards --out charts/kvmesh/dashboards`")


def test_generate_command_writes_and_prunes(tmp_path):
    (tmp_path / "old-dashboard.json").write_text("{}")
    assert main(["dashboard", "generate", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [d.FILE_NAME]
    assert json.loads((tmp_path / d.FILE_NAME).read_text())["uid"] == d.UID


def test_every_query_selects_one_deployment_and_uses_known_variables():
    names = {v.name for v in d.VARIABLES} | {"__rate_interval"}
    for panel in d.PANELS:
        assert bool(panel.queries) != bool(panel.text), panel.title
        for q in panel.queries:
            used = set(re.findall(r"\$(\w+)", q.expr))
            assert used <= names, (panel.title, used - names)
            if not q.slo:  # every measured series is scoped to the chosen deployment
                assert 'namespace="$namespace"' in q.expr and f'{d.DEPLOYMENT_LABEL}="$deployment"' in q.expr
            assert q.expr.count("(") == q.expr.count(")") and q.expr.count("{") == q.expr.count("}")


def test_substitute_fills_every_variable():
    values = d.default_values("ns", "llm", "2m")
    expr = d.substitute(d.PANELS[0].queries[0].expr, values)
    assert "$" not in expr and 'namespace="ns"' in expr and "[2m]" in expr and "histogram_quantile(0.95," in expr
    assert d.substitute("${percentile}/$percentile", {"percentile": "0.9"}) == "0.9/0.9"
    with pytest.raises(KeyError):
        d.substitute("$nope", values)


def test_slo_choices_are_bucket_bounds_as_exposed():
    by_name = {v.name: v for v in d.VARIABLES}
    assert by_name["ttft_slo"].options == d.le_values(REQUEST_LATENCY_BUCKETS)
    assert by_name["tpot_slo"].options == d.le_values(TOKEN_LATENCY_BUCKETS)
    for v in by_name.values():
        assert not v.options or v.default in v.options, v.name
    assert d.le_values((1.0, 0.05)) == ("1.0", "0.05")  # how prometheus_client writes `le`


def test_attainment_and_goodput_use_the_slo_bucket():
    assert 'le="$ttft_slo"' in d.attainment(d.TTFT, "ttft_slo")
    assert d.GOODPUT_LOWER_BOUND.startswith("clamp_min(") and 'le="$tpot_slo"' in d.GOODPUT_LOWER_BOUND


def test_legend_fills_labels():
    assert d.legend("{{component}} {{ tier }}", {"component": "decode", "tier": "gpu"}) == "decode gpu"
    assert d.legend("SLO", {}) == "SLO"


def test_grafana_model():
    model = d.dashboard()
    variables = [v["name"] for v in model["templating"]["list"]]
    assert variables == ["datasource", "namespace", "deployment", "percentile", "ttft_slo", "tpot_slo"]
    panels = model["panels"]
    assert [p["title"] for p in panels] == [p.title for p in d.PANELS]
    assert len({p["id"] for p in panels}) == len(panels)
    boxes = {(p["gridPos"]["x"], p["gridPos"]["y"]) for p in panels}
    assert len(boxes) == len(panels)  # no two panels on top of each other
    ttft = panels[0]
    assert ttft["fieldConfig"]["overrides"][0]["matcher"]["options"] == "SLO"
    assert all(t["datasource"]["uid"] == "${datasource}" for p in panels for t in p.get("targets", []))


def _podmonitor_relabelings() -> list[dict]:
    text = (ROOT / "charts" / "kvmesh" / "templates" / "podmonitor.yaml").read_text()
    block = text.split("relabelings:", 1)[1].split("{{", 1)[0]
    return yaml.safe_load(block)


def test_chart_relabeling_produces_the_dashboard_labels():
    def meta(pod_label: str) -> str:  # Prometheus's Kubernetes discovery spelling of a pod label
        return "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", pod_label)

    rules = {r["targetLabel"]: r["sourceLabels"] for r in _podmonitor_relabelings()}
    assert rules[d.DEPLOYMENT_LABEL] == [meta(OWNER_LABEL)]
    assert rules[d.COMPONENT_LABEL] == [meta("app.kubernetes.io/component")]


def test_snapshot_refuses_an_slo_that_is_no_bucket_bound(tmp_path, capsys):
    rc = main(["dashboard", "snapshot", "--prometheus", "http://127.0.0.1:9", "--out", str(tmp_path),
               "--namespace", "ns", "--deployment", "llm", "--ttft-slo", "0.30"])
    assert rc == 2 and "not a bucket bound" in capsys.readouterr().err


def test_snapshot_names_an_unreachable_prometheus(tmp_path, capsys):
    rc = main(["dashboard", "snapshot", "--prometheus", "http://127.0.0.1:9", "--out", str(tmp_path),
               "--namespace", "ns", "--deployment", "llm"])
    assert rc == 1 and "127.0.0.1:9/api/v1/query_range" in capsys.readouterr().err


def test_ttft_and_tpot_panels_show_the_routers_end_to_end_series():
    by_title = {p.title: p for p in d.PANELS}
    for title, hist in (("TTFT at the SLO percentile", "kvmesh_router_time_to_first_token_seconds"),
                        ("TPOT at the SLO percentile", "kvmesh_router_time_per_output_token_seconds")):
        (e2e,) = [q for q in by_title[title].queries if q.legend == "end to end (router)"]
        assert e2e.expr == d.quantile(hist, d.ROUTER_STREAMED if "TTFT" in title else d.ROUTER)
        assert 'component="router"' in e2e.expr and hist + "_bucket" in e2e.expr
    ttft_e2e = by_title["TTFT at the SLO percentile"].queries[0].expr
    # First-token times only: a body that is not streamed is the whole response.
    assert 'stream="true"' in ttft_e2e
    legends = {q.legend: q.expr for q in by_title["SLO attainment"].queries}
    assert 'le="$ttft_slo"' in legends["TTFT end to end (router)"]
    assert 'stream="true"' in legends["TTFT end to end (router)"]
    assert 'le="$tpot_slo"' in legends["TPOT end to end (router)"]
