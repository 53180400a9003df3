"""Every panel of the SLO dashboard against a real Prometheus (Debian's `prometheus`) scraping a
real fleet under load: two `kvmesh serve` engines on a tiny random model, a `kvmesh router`
(round-robin, with a third engine killed after the router saw it healthy, so that requests are
retried), and a `kvmesh cache-node`. Targets carry the labels the chart's PodMonitors attach.
The operator's /metrics comes from an autoscaler control loop (AutoscaleRunner with the direct
pod-scrape source) ticking over the two engines, served on the operator's health endpoint.

After the load, each panel's PromQL, with the template variables filled in, parses and returns
at least one series with a value; the variables' own queries find the deployment; and
`kvmesh dashboard snapshot` draws the SLO panels (into $KVMESH_DASHBOARD_PNG_DIR when set, which
is how docs/img/dashboard/ was made).
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
from pathlib import Path

import httpx
import pytest

from kvmesh.operator import dashboards as d
from kvmesh.operator.autoscale_loop import AutoscaleIO, AutoscaleRunner
from kvmesh.operator.health import HealthState, serve_health
from kvmesh.operator.metrics import OperatorMetrics
from kvmesh.operator.metrics_source import PodScrapeSource
from kvmesh.operator.scaling import PodInfo
from kvmesh.operator.dashboard_snapshot import query, render, slo_panels
from tests.support.processes import NodeProc
from tests.support.tiny_models import make_tiny_hf_model
from kvmesh.engine.util.localproc import free_port_pair
from tests.support.processes import RouterProcess
from tests.support.processes import ServerProcess

from tests.support.prometheus import PrometheusProcess, PrometheusUnavailable, prometheus_binary

pytestmark = pytest.mark.slow  # a real Prometheus and every dashboard panel: about 90 s

NS, NAME = "serving", "llm"
RATE_INTERVAL = "30s"  # 30 one-second scrapes: rates see the whole busy phase
# SLOs (bucket bounds) near what a tiny model on a shared CPU gets, so attainment is not flat.
SLO = {"ttft_slo": "0.2", "tpot_slo": "0.02", "percentile": "0.9"}
SHARED = "You are kvmesh's test assistant. Answer in one short sentence, and be exact. " * 3


def engine(model: Path) -> ServerProcess:
    # A small KV pool and batch so that heavy load queues, fills the pool and may preempt.
    return ServerProcess("--model", str(model), "--dtype", "float32", "--num-kv-blocks", "40",
                         "--block-size", "16", "--max-num-seqs", "4", "--num-threads", "1",
                         "--kv-events-port", str(free_port_pair()))


class OperatorLoop:
    """The autoscaler ticking every second over the engines (a colocated decode pool, scaling on),
    its metrics on a health endpoint; the cluster side is a CR dict whose status takes the patches."""

    def __init__(self, engines: list[ServerProcess]) -> None:
        self.obj = {"metadata": {"namespace": NS, "name": NAME, "generation": 1}, "spec": {
            "model": {"name": "tiny"}, "prefill": {"replicas": 0},
            "decode": {"replicas": 2, "minReplicas": 1, "maxReplicas": 4},
            "slo": {"ttftMs": 200, "tpotMs": 20, "percentile": 90},
            "autoscaling": {"enabled": True, "metricsWindowSeconds": 30,
                            "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 5}}}
        pods = [PodInfo(f"{NAME}-decode-5d8c7-{i}", f"127.0.0.1:{e.port}", 0) for i, e in enumerate(engines)]
        self.metrics = OperatorMetrics()
        self.runner = AutoscaleRunner(PodScrapeSource(), AutoscaleIO(
            ready_pods=lambda ns, name, pool: pods, start_drain=lambda pod: None, cancel_drain=lambda pod: None,
            in_flight=lambda pod: 0, is_draining=lambda pod: False, record_drain=lambda ns, pod, record: None,
            recorded_drains=lambda ns, name, pool: [], mark_for_deletion=lambda ns, pod: None,
            patch_status=self._patch_status, apply_replicas=lambda ns, name: None,
            event=lambda obj, reason, message: None), metrics=self.metrics)
        self.loop = asyncio.new_event_loop()
        self.stopped = threading.Event()
        self.port = 0

    def _patch_status(self, ns: str, name: str, patch: dict) -> None:
        status = self.obj.setdefault("status", {})
        for key, value in patch.items():
            if key == "autoscaling":
                for pool, fields in value.items():
                    status.setdefault(key, {}).setdefault(pool, {}).update(fields)
            else:
                status[key] = value

    def start(self) -> "OperatorLoop":
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        state = HealthState("operator", metrics=self.metrics.exposition)
        server = asyncio.run_coroutine_threadsafe(serve_health(state, "127.0.0.1", 0), self.loop).result(30)
        self.port = server.sockets[0].getsockname()[1]
        threading.Thread(target=self._tick_forever, daemon=True).start()
        return self

    def _tick_forever(self) -> None:
        while not self.stopped.wait(1.0):
            self.runner.tick(self.obj, time.time())

    def stop(self) -> None:
        self.stopped.set()
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    try:
        prometheus_binary()
    except PrometheusUnavailable as exc:
        pytest.skip(str(exc))
    model = make_tiny_hf_model("llama", tmp_path_factory.mktemp("tiny"))
    procs: list = []
    try:
        engines = [engine(model).start() for _ in range(2)]
        doomed = engine(model).start()
        procs += engines + [doomed]
        router = RouterProcess("--engines", ",".join(e.base_url for e in engines + [doomed]),
                               "--policy", "round-robin", "--model", "tiny", "--model-path", str(model),
                               "--health-interval-s", "3600").start()
        procs.append(router)
        # The router believes in it; requests it sends there fail before any byte and are retried.
        doomed.proc.kill()
        doomed.proc.wait(30)
        cache = NodeProc().start()
        procs.append(cache)
        pool = {"namespace": NS, d.DEPLOYMENT_LABEL: NAME}
        targets = {f"127.0.0.1:{e.port}": {**pool, "component": "decode", "pod": f"{NAME}-decode-5d8c7-{i}"}
                   for i, e in enumerate(engines)}
        targets[f"127.0.0.1:{router.port}"] = {**pool, "component": "router", "pod": f"{NAME}-router-6f9d-0"}
        targets[f"127.0.0.1:{cache.http_port}"] = {**pool, "component": "cache", "pod": f"{NAME}-cache-7c4b-0"}
        operator = OperatorLoop(engines).start()
        procs.append(operator)
        # Its series carry their own namespace/inference_deployment/component (the chart's
        # operator PodMonitor honors them); the target adds no labels that would clash.
        targets[f"127.0.0.1:{operator.port}"] = {}
        prom = PrometheusProcess(targets).start()
        procs.append(prom)
        yield engines, router, prom
    finally:
        for p in reversed(procs):
            p.stop()


def run_load(router: RouterProcess, model_id: str, clients: int, seconds: float) -> tuple[int, list[str]]:
    """Closed-loop clients through the router, streaming and not; prompts share a prefix (prefix
    cache hits)."""
    stop, done, errors = threading.Event(), [0], []

    def client(c: int) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            # Every other one streamed: the router's end-to-end TTFT/TPOT series time streams only.
            body = {"model": model_id, "prompt": f"{SHARED} Client {c}, question {i}?", "max_tokens": 24,
                    "ignore_eos": True, "temperature": 0, "stream": i % 2 == 0}
            r = httpx.post(router.url("/v1/completions"), json=body, timeout=300)
            if r.status_code == 200:
                done[0] += 1
            else:
                errors.append(f"{r.status_code} {r.text[:200]}")

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(clients)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(300)
    return done[0], errors


def wait_scraped(prom: PrometheusProcess, n: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while prom.targets_up() < n:
        assert time.monotonic() < deadline, f"Prometheus scrapes fewer than {n} targets:\n{prom.log_tail()}"
        time.sleep(0.5)


def test_every_panel_returns_series_after_load(fleet, tmp_path):
    engines, router, prom = fleet
    wait_scraped(prom, 5)
    model_id = httpx.get(engines[0].url("/v1/models"), timeout=30).json()["data"][0]["id"]
    start = time.time()
    light = run_load(router, model_id, clients=1, seconds=15)
    heavy = run_load(router, model_id, clients=8, seconds=25)
    at = time.time() + 3  # the last scrape of the busy phase is in
    time.sleep(3)
    for done, errors in (light, heavy):
        assert done > 0 and not errors, errors[:3]

    values = {**d.default_values(NS, NAME, RATE_INTERVAL), **SLO}
    empty = []
    for panel in d.PANELS:
        for q in panel.queries:
            series = query(prom.url, d.substitute(q.expr, values), at=at)  # raises if it does not parse
            if not any(s.points for s in series):
                empty.append(f"{panel.title} / {q.legend}: {d.substitute(q.expr, values)}")
    assert not empty, "queries without a value after the load:\n" + "\n".join(empty)
    # The counter itself: the retries came when the router first met the dead engine, and a
    # series' first sample is not an increase to rate().
    retries = query(prom.url, d.substitute(f"sum(kvmesh_router_retries_total{{{d.ROUTER}}})", values), at=at)
    assert retries and retries[0].points[0][1] > 0

    # The variables' label_values() queries: their selectors find this deployment.
    for var in d.VARIABLES:
        if var.query:
            selector, label = re.fullmatch(r"label_values\((.*), (\w+)\)", var.query).groups()
            found = {s.labels.get(label) for s in query(prom.url, d.substitute(selector, values), at=at)}
            assert found == {NS if var.name == "namespace" else NAME}, (var.name, found)

    out = Path(os.environ.get("KVMESH_DASHBOARD_PNG_DIR") or tmp_path / "png")
    time.sleep(15)  # an idle tail, as an operator would see it after a burst
    paths = render(prom.url, {**values, "__rate_interval": "15s"}, start - 10, time.time(), out, step_s=2)
    assert len(paths) == len(slo_panels()) + 1
    assert all(p.stat().st_size > 10_000 for p in paths), [(p.name, p.stat().st_size) for p in paths]
