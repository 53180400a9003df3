"""``/kv/info`` and ``/kv/snapshot`` over a fake engine; the ``kvmesh serve`` flags that start the stream."""

from __future__ import annotations

import argparse
import threading

import pytest
import torch
from fastapi.testclient import TestClient

from kvmesh.engine.block_hash import ROOT_HASH, extra_key
from kvmesh.engine.kv.event_publisher import KVEventPublisher
from kvmesh.engine.kv.event_wire import snapshot_from_json
from kvmesh.engine.kv.events import BlockRemoved, BlockStored, KVEventLog
from kvmesh.engine.server.app import ServerApp
from kvmesh.engine.server.async_engine import AsyncEngine
from kvmesh.engine.server.cli import add_serve_arguments, settings_from_args

from tests.support.fake_step_engine import FakeEngine
from tests.support.waits import wait_for
from kvmesh.engine.util.localproc import free_port_pair


class _KV:
    def __init__(self, extra: bytes) -> None:
        self.extra = extra
        self.pool = type("Pool", (), {"tier": "gpu"})()


class KVFakeEngine(FakeEngine):
    """FakeEngine plus what the KV routes read from a real engine."""

    def __init__(self) -> None:
        super().__init__()
        self.engine_id = "engine-fake"
        self.dtype = torch.bfloat16
        self.config.cache_salt = "tenant-7"
        self.kv = _KV(extra_key("fake-model", "bfloat16", cache_salt="tenant-7"))
        self.events = KVEventLog(self.engine_id)



def test_routes_answer_503_until_loaded_then_describe_the_cache():
    engine = KVFakeEngine()
    release = threading.Event()

    def factory():
        release.wait(10)
        return engine

    port = free_port_pair()
    publisher = KVEventPublisher("127.0.0.1", port)
    server = ServerApp(AsyncEngine(factory), kv_publisher=publisher)
    with TestClient(server.app) as client:
        for path in ("/kv/info", "/kv/snapshot"):
            r = client.get(path)
            assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
        release.set()
        wait_for(lambda: client.get("/ready").status_code == 200)

        h1, h2 = b"\x01" * 32, b"\x02" * 32
        engine.events.publish(BlockStored([h1, h2], None, list(range(8)), 4))
        engine.events.publish(BlockRemoved([h1]))
        snap = snapshot_from_json(client.get("/kv/snapshot").json())
        assert snap == engine.events.snapshot() and snap.seq == 2 and snap.hashes["gpu"] == {h2}

        info = client.get("/kv/info").json()
        assert info == {
            "engine_id": "engine-fake", "block_size": 4, "hash_function": "sha256",
            "root_hash": ROOT_HASH.hex(), "extra_key": engine.kv.extra.hex(),
            "model": "fake-model", "dtype": "bfloat16", "lora": None, "cache_salt": "tenant-7",
            "kv_events": {"port": port, "replay_port": port + 1, "topic": "kv-events/engine-fake",
                          "format": "kvmesh"},
            "tiers": ["gpu"], "role": "both", "transfer_port": None, "tokenizer": engine.tokenizer.fingerprint,
            "max_model_len": 64, "served_model_names": ["fake-model", "default"],
            "hybrid": False, "state_checkpoints": None,  # an attention-only engine
        }
        # /ready names the same engine: a router that sees another id there resyncs (router/discovery.py).
        assert client.get("/ready").json()["engine_id"] == info["engine_id"]
        # The readable parts rebuild the exact bytes the engine hashes.
        assert extra_key(info["model"], info["dtype"], info["lora"], info["cache_salt"]).hex() == info["extra_key"]
        assert publisher.log is engine.events  # started on load
    # Stopped on shutdown: both ports are free again.
    KVEventPublisher("127.0.0.1", port).bind()


def test_info_without_a_stream_says_so():
    engine = KVFakeEngine()
    with TestClient(ServerApp(AsyncEngine(lambda: engine)).app) as client:
        wait_for(lambda: client.get("/ready").status_code == 200)
        assert client.get("/kv/info").json()["kv_events"] is None


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return p.parse_args(list(argv))


def test_serve_flags():
    off = settings_from_args(_parse())
    assert off.kv_events_port == 0
    on = settings_from_args(_parse("--host", "0.0.0.0", "--kv-events-port", "5557"))
    assert (on.kv_events_port, on.kv_events_host) == (5557, "0.0.0.0")
    own = settings_from_args(_parse("--kv-events-port", "6000", "--kv-events-host", "127.0.0.2"))
    assert own.kv_events_host == "127.0.0.2"
    for bad in ("65535", "-1", "x"):
        with pytest.raises(SystemExit):
            _parse("--kv-events-port", bad)


def test_serve_refuses_a_busy_kv_events_port_before_loading(caplog):
    from kvmesh.engine.server.runtime import serve
    from kvmesh.engine.server.settings import ServeSettings

    port = free_port_pair()
    with KVEventPublisher("127.0.0.1", port):
        assert serve(ServeSettings(kv_events_port=port)) == 2
    assert "--kv-events-port" in caplog.text
