"""POST/GET /admin/drain over a fake engine: the SIGTERM drain, asked for over HTTP."""

from __future__ import annotations

import asyncio
import json
import threading
import time

from fastapi.testclient import TestClient

from kvmesh.engine.server.app import ServerApp
from kvmesh.engine.server.async_engine import AsyncEngine, ServerState
from kvmesh.engine.server.runtime import build_server
from kvmesh.engine.server.settings import ServeSettings

from tests.support.fake_step_engine import FakeEngine
from tests.support.waits import wait_for



async def _loaded_server():
    """A server built as `kvmesh serve` builds it, on the fake engine, loaded; and its app."""
    server = build_server(ServeSettings(drain_timeout_s=5), engine_factory=FakeEngine)
    server.aengine.start()
    await server.aengine.loaded.wait()
    return server, server.config.app.state.server


def test_admin_drain_stops_readiness_finishes_inflight_and_reports_zero():
    engine = FakeEngine(step_delay_s=0.02)
    server = ServerApp(AsyncEngine(lambda: engine), drain_timeout_s=60)
    with TestClient(server.app) as c:
        wait_for(lambda: c.get("/ready").status_code == 200)
        assert c.get("/admin/drain").json()["draining"] is False
        got: list = []

        def stream() -> None:
            body = {"prompt": "a", "max_tokens": 40, "stream": True}
            with c.stream("POST", "/v1/completions", json=body) as r:
                got.extend(json.loads(line[6:]) for line in r.iter_lines()
                           if line.startswith("data: {"))

        t = threading.Thread(target=stream)
        t.start()
        wait_for(lambda: engine.generation_tokens >= 2)
        r = c.post("/admin/drain")
        assert r.status_code == 202
        st = r.json()
        assert st["draining"] is True and st["in_flight"] == 1 and st["timeout_s"] == 60
        assert c.get("/ready").status_code == 503
        refused = c.post("/v1/completions", json={"prompt": "a"})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        assert c.post("/admin/drain").status_code == 202  # asking again joins the same drain
        t.join(30)
        wait_for(lambda: c.get("/admin/drain").json()["done"])
        st = c.get("/admin/drain").json()
        assert (st["in_flight"], st["aborted"], st["state"]) == (0, 0, "draining")
        assert got[-1]["choices"][0]["finish_reason"] == "length"  # not cut
        assert c.get("/health").status_code == 200  # drained, not dead: no restart


def test_sigterm_during_an_admin_drain_joins_it():
    async def main() -> None:
        server, app = await _loaded_server()
        assert app.drainer is server.drainer  # one drain, whoever asks
        task = app.drainer.start("POST /admin/drain")
        await server.drain("SIGTERM")
        assert task.done() and app.drainer.reason == "POST /admin/drain"
        assert server.should_exit and server.aengine.state is ServerState.DRAINING
        await server.aengine.shutdown()

    asyncio.run(main())


def test_an_admin_drain_can_be_cancelled_and_the_server_serves_again():
    """The operator scaled the pool up while this pod drained (DELETE /admin/drain)."""
    engine = FakeEngine(step_delay_s=0.0)
    server = ServerApp(AsyncEngine(lambda: engine), drain_timeout_s=60)
    with TestClient(server.app) as c:
        wait_for(lambda: c.get("/ready").status_code == 200)
        assert c.post("/admin/drain").status_code == 202
        assert c.get("/ready").status_code == 503
        r = c.delete("/admin/drain")
        assert r.status_code == 200 and r.json()["draining"] is False and r.json()["state"] == "ready"
        assert c.get("/ready").status_code == 200
        assert c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200
        assert c.post("/admin/drain").status_code == 202  # and it can be drained again later
        wait_for(lambda: c.get("/admin/drain").json()["done"])


def test_a_shutdowns_drain_cannot_be_cancelled():
    async def main() -> None:
        server, app = await _loaded_server()
        await server.drain("SIGTERM")
        assert app.drainer.cancel() is False and server.aengine.state is ServerState.DRAINING
        await server.aengine.shutdown()

    asyncio.run(main())


def test_a_leased_drain_holds_while_renewed_and_serves_again_when_its_lease_runs_out():
    """The operator renews its drain's lease every tick; an operator that died mid-drain (and a
    next leader that did not take the drain over) must not leave the pod unready for ever."""
    engine = FakeEngine(step_delay_s=0.0)
    server = ServerApp(AsyncEngine(lambda: engine), drain_timeout_s=60)
    with TestClient(server.app) as c:
        wait_for(lambda: c.get("/ready").status_code == 200)
        r = c.post("/admin/drain", params={"lease_s": 0.6})
        assert r.status_code == 202 and r.json()["lease_expires_at"] > time.time()
        for _ in range(4):  # renewed faster than it runs out: still drained after 1.2 s
            time.sleep(0.3)
            assert c.post("/admin/drain", params={"lease_s": 0.6}).status_code == 202
            assert c.get("/ready").status_code == 503
        wait_for(lambda: c.get("/ready").status_code == 200, timeout=5)
        st = c.get("/admin/drain").json()
        assert st["draining"] is False and st["lease_expires_at"] is None
        assert c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200
        # Without a lease a drain holds until it is cancelled.
        assert c.post("/admin/drain").status_code == 202
        time.sleep(0.8)
        assert c.get("/ready").status_code == 503
        assert c.delete("/admin/drain").status_code == 200


def test_a_drain_lease_out_of_range_is_refused_with_the_field_named():
    engine = FakeEngine(step_delay_s=0.0)
    server = ServerApp(AsyncEngine(lambda: engine), drain_timeout_s=60)
    with TestClient(server.app) as c:
        wait_for(lambda: c.get("/ready").status_code == 200)
        for bad in ("0", "-1", "abc", "1e9"):
            r = c.post("/admin/drain", params={"lease_s": bad})
            assert r.status_code == 400, (bad, r.text)
            assert "lease_s" in r.text
        assert c.get("/ready").status_code == 200  # nothing was drained


def test_a_shutdown_joining_a_leased_drain_is_not_undone_by_the_lease():
    async def main() -> None:
        server, app = await _loaded_server()
        app.drainer.start("POST /admin/drain", lease_s=0.2)
        await server.drain("SIGTERM")
        await asyncio.sleep(0.4)
        assert app.drainer.started and app.drainer.lease_expires_at is None
        assert server.aengine.state is ServerState.DRAINING
        await server.aengine.shutdown()

    asyncio.run(main())
