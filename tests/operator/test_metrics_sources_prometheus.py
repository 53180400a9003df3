"""Both metric sources against the same real traffic: a real Prometheus
(Debian's `prometheus`) and the operator's own scrape, reading two real
`kvmesh serve` processes on a tiny random model under a load generator.

Under load both lead `decide` to the same scale-up; after the load, to the
same scale-down; and the samples they produce agree.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from kvmesh.operator.autoscaler import AutoscalerState, MetricsWindow, decide
from kvmesh.operator.metrics_source import (
    PodScrapeSource,
    PoolTarget,
    PrometheusSource,
    sources_agree,
)
from kvmesh.operator.spec import parse_spec
from tests.support.tiny_models import make_tiny_hf_model
from tests.support.processes import ServerProcess

from tests.support.prometheus import PrometheusProcess, PrometheusUnavailable, prometheus_binary

pytestmark = pytest.mark.slow  # a real Prometheus scraping real engines: about 80 s

WINDOW_S = 30
PODS = ("llm-decode-5d8c7b9f4-aaaaa", "llm-decode-5d8c7b9f4-bbbbb")


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    model = make_tiny_hf_model("llama", tmp_path_factory.mktemp("tiny"))
    procs = []
    try:
        for _ in PODS:
            # A small KV pool so that the load shows up as occupancy.
            procs.append(ServerProcess("--model", str(model), "--dtype", "float32",
                                       "--num-kv-blocks", "48", "--block-size", "16",
                                       "--max-num-seqs", "8", "--num-threads", "1").start())
        yield procs
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def prometheus(engines):
    try:
        prometheus_binary()
    except PrometheusUnavailable as exc:
        pytest.skip(str(exc))
    prom = PrometheusProcess({f"127.0.0.1:{e.port}": {"namespace": "serving", "pod": pod}
                              for e, pod in zip(engines, PODS)}).start()
    yield prom
    prom.stop()


class Load:
    """Closed-loop clients sending completions until stopped."""

    def __init__(self, engines, clients_per_engine: int = 2) -> None:
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.done = 0
        self.threads = [threading.Thread(target=self._client, args=(e,), daemon=True)
                        for e in engines for _ in range(clients_per_engine)]

    def _client(self, engine) -> None:
        model = httpx.get(engine.url("/v1/models"), timeout=30).json()["data"][0]["id"]
        i = 0
        while not self.stop.is_set():
            i += 1
            body = {"model": model, "prompt": f"request {i}: " + "the quick brown fox " * 5,
                    "max_tokens": 16, "ignore_eos": True, "temperature": 0}
            r = httpx.post(engine.url("/v1/completions"), json=body, timeout=120)
            if r.status_code != 200:
                self.errors.append(f"{r.status_code} {r.text[:200]}")
            else:
                self.done += 1

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(180)


def spec(ttft_ms: int, tpot_ms: int):
    return parse_spec({
        "model": {"name": "m"}, "prefill": {"replicas": 0},
        "decode": {"replicas": 2, "minReplicas": 1, "maxReplicas": 8},
        "slo": {"ttftMs": ttft_ms, "tpotMs": tpot_ms, "percentile": 90},
        "autoscaling": {"enabled": True, "kvOccupancyTarget": 0.9, "scaleUpStabilizationSeconds": 0,
                        "scaleDownStabilizationSeconds": 0, "metricsWindowSeconds": WINDOW_S},
    })


def both_samples(engines, prom, scrape, now):
    target = PoolTarget("serving", "llm", "decode", tuple(f"127.0.0.1:{e.port}" for e in engines),
                        window_s=WINDOW_S, percentile=90)
    return PrometheusSource(prom.url).sample(target, now), scrape.sample(target, now)


def decision(s, sample):
    decisions, _ = decide(s, MetricsWindow({"decode": (sample,)}),
                          AutoscalerState(replicas={"decode": 2}), sample.t)
    return decisions["decode"]


def wait_scraped(prom, n, timeout=60):
    deadline = time.monotonic() + timeout
    while prom.targets_up() < n:
        assert time.monotonic() < deadline, f"Prometheus did not scrape the engines:\n{prom.log_tail()}"
        time.sleep(0.5)


def test_prometheus_and_direct_scrape_give_the_same_decisions(engines, prometheus):
    wait_scraped(prometheus, len(engines))
    scrape = PodScrapeSource()
    with Load(engines) as load:
        both_samples(engines, prometheus, scrape, time.time())  # the scrape source's baseline
        time.sleep(WINDOW_S - 3)  # the baseline must stay inside the window, as for rate()
        via_prom, via_scrape = both_samples(engines, prometheus, scrape, time.time())
    assert not load.errors and load.done > 0
    assert via_prom.pods == via_scrape.pods == 2
    assert via_prom.ttft_s and via_prom.tpot_s, (via_prom, via_scrape, load.done)
    assert not sources_agree(via_prom, via_scrape), (via_prom, via_scrape)
    # One SLO at a third of what the traffic gets, the other far above it: both sources must ask
    # for more decode replicas, for that SLO. (Both tight at once, which one is missed by more
    # is a near tie that the two sources' different quantile estimates may break either way.)
    ttft_ms, tpot_ms = via_prom.ttft_s * 1000, via_prom.tpot_s * 1000
    for tight, reason in ((spec(ttft_ms=max(1, int(ttft_ms / 3)), tpot_ms=int(tpot_ms * 100) + 1),
                           "TTFTAboveSLO"),
                          (spec(ttft_ms=int(ttft_ms * 100) + 1, tpot_ms=max(1, int(tpot_ms / 3))),
                           "TPOTAboveSLO")):
        up_prom, up_scrape = decision(tight, via_prom), decision(tight, via_scrape)
        assert up_prom.desired > 2 and up_prom.slo_met is False, up_prom
        assert up_prom.reason == up_scrape.reason == reason, (up_prom, up_scrape)
        assert up_prom.desired == up_scrape.desired, (up_prom, up_scrape)

    # After the load: no request in the window, KV free again -> both scale down by one.
    time.sleep(WINDOW_S + 3)
    idle_prom, idle_scrape = both_samples(engines, prometheus, scrape, time.time())
    assert idle_prom.ttft_s is None and idle_scrape.ttft_s is None
    down_prom, down_scrape = decision(tight, idle_prom), decision(tight, idle_scrape)
    assert (down_prom.desired, down_prom.reason) == (1, "UnderUtilized")
    assert (down_scrape.desired, down_scrape.reason) == (1, "UnderUtilized")
