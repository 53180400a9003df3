"""An idle server's /metrics follows counters that move between steps.

Real: the engine (tiny random Llama), its write-through to a `kvmesh cache-node` process over
ucxx, the HTTP app and its /metrics. The put of a step's full blocks is confirmed after the step
returned; with no request after it, the figure must still arrive (before: it stayed at the last
step's until the next request came)."""

from __future__ import annotations

import dataclasses

import pytest
from fastapi.testclient import TestClient

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.server.app import ServerApp
from kvmesh.engine.server.async_engine import AsyncEngine
from kvmesh.engine.util.metrics import parse_samples, sample_value

from tests.support.processes import NodeProc
from tests.support.tiny_engine import BS, loaded, model_dir  # noqa: F401 - pytest fixtures
from tests.support.waits import wait_for

pytestmark = pytest.mark.timeout(120)


def test_write_through_confirmed_after_the_last_step_shows_in_metrics(model_dir, loaded):  # noqa: F811
    node = NodeProc(events=False).start()
    config = EngineConfig(model=str(model_dir), dtype="float32", device="cpu", block_size=BS, num_kv_blocks=48,
                          cache_node=f"127.0.0.1:{node.http_port}")

    engines: list[LLMEngine] = []

    def factory() -> LLMEngine:
        engines.append(LLMEngine(config, loaded=dataclasses.replace(loaded, weights=dict(loaded.weights))))
        return engines[0]

    def remote(name: str) -> float:
        return sample_value(parse_samples(client.get("/metrics").text), name, tier="remote") or 0.0

    try:
        with TestClient(ServerApp(AsyncEngine(factory)).app) as client:
            wait_for(lambda: client.get("/ready").status_code == 200, "engine loaded", timeout=60)
            # The link resolves the node in the background; a save before that is dropped (counted).
            wait_for(lambda: engines[0]._cache_node.clients() is not None, "the node resolved", timeout=20)
            prompt = [(7 * j) % 300 + 20 for j in range(4 * BS + 1)]
            r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
            assert r.status_code == 200, r.text
            wait_for(lambda: remote("kvmesh_kv_tier_stored_total") == 4,
                     "/metrics to count the prompt's 4 full blocks stored, with no request after", timeout=15)
            assert remote("kvmesh_kv_tier_dropped_saves_total") == 0
    finally:
        node.stop()
