"""The Gateway API Inference Extension's model-server metrics, scraped from a real engine.

Real: the engine (tiny random Llama from tests/support/tiny_engine.py: every layer, the paged KV,
the scheduler), the HTTP server app and its /metrics route; the exposition is parsed with
prometheus_client's text parser, as a scraper would. The names and label keys are the ones the
upstream endpoint picker (sigs.k8s.io/gateway-api-inference-extension v1.5.0,
pkg/epp/server/options.go and docs/proposals/003-model-server-protocol) reads by default.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.server.app import ServerApp
from kvmesh.engine.server.async_engine import AsyncEngine

from tests.support.tiny_engine import BS, loaded, model_dir  # noqa: F401 - pytest fixtures
from tests.support.waits import wait_for

NUM_BLOCKS = 48
# The EPP's defaults: TotalQueuedRequests, TotalRunningRequests, KVCacheUtilization, LoRA info,
# cache info (block size, number of blocks).
GIE_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
              "vllm:lora_requests_info", "vllm:cache_config_info")


@pytest.fixture
def served(model_dir, loaded):  # noqa: F811 - the fixtures imported above
    config = EngineConfig(model=str(model_dir), dtype="float32", device="cpu", block_size=BS,
                          num_kv_blocks=NUM_BLOCKS)
    engines: list[LLMEngine] = []

    def factory() -> LLMEngine:
        engines.append(LLMEngine(config, loaded=dataclasses.replace(loaded, weights=dict(loaded.weights))))
        return engines[0]

    started = time.time()
    with TestClient(ServerApp(AsyncEngine(factory)).app) as client:
        wait_for(lambda: client.get("/ready").status_code == 200, "engine loaded", timeout=60)
        yield client, engines[0], started


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_engine_exports_what_the_endpoint_picker_reads(served):
    client, engine, started = served
    prompt = [(7 * j) % 300 + 20 for j in range(4 * BS + 1)]
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0,
                                             "ignore_eos": True})
    assert r.status_code == 200, r.text
    fams = _families(client.get("/metrics").text)
    for name in GIE_GAUGES:
        assert name in fams, f"{name} missing from /metrics"
        assert fams[name].type == "gauge", (name, fams[name].type)
        assert len(fams[name].samples) == 1, (name, fams[name].samples)
    value = {name: fams[name].samples[0].value for name in GIE_GAUGES}
    labels = {name: fams[name].samples[0].labels for name in GIE_GAUGES}

    assert value["vllm:num_requests_waiting"] == 0 and value["vllm:num_requests_running"] == 0
    # The request's 4 full prompt blocks stay cached but free: usage counts blocks held by requests.
    assert value["vllm:kv_cache_usage_perc"] == 0.0
    assert labels["vllm:cache_config_info"]["block_size"] == str(BS)
    assert labels["vllm:cache_config_info"]["num_gpu_blocks"] == str(engine.stats().num_kv_blocks)
    assert int(labels["vllm:cache_config_info"]["num_gpu_blocks"]) == NUM_BLOCKS
    # No adapters: empty lists, max_lora 0, and the time the model was loaded as the value.
    lora = labels["vllm:lora_requests_info"]
    assert (lora["running_lora_adapters"], lora["waiting_lora_adapters"], lora["max_lora"]) == ("", "", "0")
    assert started <= value["vllm:lora_requests_info"] <= time.time()
    # The kvmesh_* series say the same (one snapshot feeds both).
    assert fams["kvmesh_kv_cache_blocks"].samples[0].value == NUM_BLOCKS


def test_a_running_request_shows_as_running_and_holding_cache(served):
    """While a request decodes, the picker sees it running and its blocks in use; the figures
    agree with kvmesh's own series (one snapshot feeds both)."""
    client, _, _ = served
    prompt = [(11 * j) % 300 + 20 for j in range(2 * BS)]
    done = threading.Event()

    def long_request() -> None:
        try:
            client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 150, "temperature": 0,
                                                 "ignore_eos": True})
        finally:
            done.set()

    t = threading.Thread(target=long_request)
    t.start()
    seen: list[dict] = []

    def running() -> bool:
        fams = _families(client.get("/metrics").text)
        if fams["vllm:num_requests_running"].samples[0].value == 1:
            seen.append(fams)
        return bool(seen) or done.is_set()

    wait_for(running, "the request running", timeout=60, every=0.002)
    t.join(60)
    assert seen, "the request finished before a scrape saw it running"
    fams = seen[0]
    usage = fams["vllm:kv_cache_usage_perc"].samples[0].value
    assert 0 < usage <= 1
    assert usage == fams["kvmesh_kv_cache_usage_ratio"].samples[0].value
    assert fams["vllm:num_requests_waiting"].samples[0].value == fams["kvmesh_num_requests_waiting"].samples[0].value
