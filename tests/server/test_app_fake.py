"""The HTTP layer over a fake engine: response shapes, streaming, errors, backpressure, metrics.

These exercise only what the server itself decides; tests/server/test_openai_e2e.py
and test_drain.py prove the same behaviours against the real engine.
"""

from __future__ import annotations

import json
import threading

import pytest
from fastapi.testclient import TestClient

from kvmesh.engine.server.app import ServerApp
from kvmesh.engine.server.async_engine import AsyncEngine, ServerState
from kvmesh.engine.util.metrics import parse_samples, render, sample_value

from tests.support.fake_step_engine import FakeEngine, FakeTokenizer, expected_text
from tests.support.waits import wait_for

TOK = FakeTokenizer()


def make_client(engine: FakeEngine, max_waiting: int = 0,
                names: list[str] | None = None) -> tuple[TestClient, ServerApp]:
    server = ServerApp(AsyncEngine(lambda: engine, max_waiting=max_waiting), names)
    return TestClient(server.app), server


@pytest.fixture
def engine():
    return FakeEngine()


@pytest.fixture
def client(engine):
    c, _ = make_client(engine)
    with c:
        wait_for(lambda: c.get("/ready").status_code == 200)
        yield c
    engine.running.set()



def _events(resp) -> list:
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def chat_prompt(content: str) -> list[int]:
    return TOK.apply_chat_template([{"role": "user", "content": content}])


# ---- bodies ---------------------------------------------------------------------------------------


def test_completion_body(client):
    r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 5})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "fake-model"
    assert body["id"].startswith("cmpl-")
    assert body["choices"] == [{"index": 0, "text": expected_text(TOK.encode("abc"), 5), "logprobs": None,
                                "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_chat_body_n_choices(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hey"}],
                                                  "max_tokens": 4, "n": 3})
    body = r.json()
    want = expected_text(chat_prompt("hey"), 4)
    assert body["object"] == "chat.completion"
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["message"] == {"role": "assistant", "content": want} for c in body["choices"])
    assert body["usage"]["completion_tokens"] == 12
    assert body["usage"]["prompt_tokens"] == len(chat_prompt("hey"))


def test_chat_default_max_tokens_fills_the_context(client, engine):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.json()["usage"]["completion_tokens"] == engine.max_model_len - len(chat_prompt("x"))


def test_echo_and_completion_logprobs(client):
    r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2, "echo": True})
    assert r.json()["choices"][0]["text"] == "ab" + expected_text(TOK.encode("ab"), 2)
    r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2, "logprobs": 1})
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 2 and lp["text_offset"] == [0, 1] and lp["token_logprobs"] == [-0.5, -0.5]


def test_chat_logprobs(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "q"}],
                                                  "max_tokens": 2, "logprobs": True, "top_logprobs": 2})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 2 and len(content[0]["top_logprobs"]) == 2


def test_served_model_name_override():
    engine = FakeEngine()
    c, _ = make_client(engine, names=["alias-a", "alias-b"])
    with c:
        wait_for(lambda: c.get("/ready").status_code == 200)
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["alias-a", "alias-b"]
        assert c.get("/v1/models/alias-b").json()["max_model_len"] == engine.max_model_len
        r = c.post("/v1/completions", json={"model": "alias-b", "prompt": "a", "max_tokens": 1})
        assert r.json()["model"] == "alias-b"
        assert c.post("/v1/completions", json={"model": "fake-model", "prompt": "a"}).status_code == 404


# ---- streaming ------------------------------------------------------------------------------------


def test_chat_stream_format(client):
    with client.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "s"}], "max_tokens": 3, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = _events(r)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    chunks = events[:-2]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    for idx in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == idx]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(m["delta"].get("content", "") for m in mine) == expected_text(chat_prompt("s"), 3)
        assert [m["finish_reason"] for m in mine][-1] == "length"
        assert all(m["finish_reason"] is None for m in mine[:-1])


def test_completion_stream_without_usage(client):
    with client.stream("POST", "/v1/completions", json={"prompt": "zz", "max_tokens": 4, "stream": True}) as r:
        events = _events(r)
    assert events[-1] == "[DONE]"
    assert all("usage" not in e for e in events[:-1])
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == expected_text(TOK.encode("zz"), 4)


# ---- errors ---------------------------------------------------------------------------------------

BAD = [
    ("/v1/chat/completions", b"{", 400, "invalid_json"),
    ("/v1/chat/completions", b"[]", 400, "invalid_request"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400, "invalid_request"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1000}, 400,
     "context_length_exceeded"),
    ("/v1/completions", {"prompt": [1000], "max_tokens": 1}, 400, "invalid_request"),
    ("/v1/completions", {"prompt": "", "max_tokens": 1}, 400, "invalid_request"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "invalid_request"),
    ("/v1/completions", {"prompt": "x", "n": 129}, 400, "invalid_request"),
    ("/v1/completions", {"prompt": ["a"] * 3, "n": 100}, 400, "invalid_request"),
    ("/v1/completions", {"model": "other", "prompt": "x"}, 404, "model_not_found"),
    ("/v1/nothing", {}, 404, "not_found"),
]


@pytest.mark.parametrize("path,body,status,code", BAD)
def test_errors_use_openai_format(client, path, body, status, code):
    if isinstance(body, bytes):
        r = client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = client.post(path, json=body)
    assert r.status_code == status
    assert r.json()["error"]["code"] == code
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    ok = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
    assert ok.status_code == 200


def test_errors_are_counted(client):
    client.post("/v1/completions", json={"model": "other", "prompt": "x"})
    client.post("/v1/completions", json={"model": "other", "prompt": "x"})
    m = parse_samples(client.get("/metrics").text)
    assert sample_value(m, "kvmesh_request_errors_total", code="model_not_found") == 2.0


# ---- backpressure and lifecycle ----------------------------------------------------------------------


def test_queue_full_gets_429_with_retry_after():
    engine = FakeEngine()
    c, server = make_client(engine, max_waiting=2)
    with c:
        wait_for(lambda: c.get("/ready").status_code == 200)
        engine.running.clear()  # the engine thread blocks in its next step: nothing starts
        results: list = []
        t = threading.Thread(target=lambda: results.append(
            c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "n": 2})))
        t.start()
        wait_for(lambda: server.aengine.num_queued == 2)
        r = c.post("/v1/completions", json={"prompt": "b", "max_tokens": 1})
        assert r.status_code == 429
        assert r.json()["error"]["code"] == "queue_full" and r.json()["error"]["type"] == "rate_limit_error"
        assert int(r.headers["retry-after"]) >= 1
        engine.running.set()
        t.join(10)
        assert results[0].status_code == 200
        assert c.post("/v1/completions", json={"prompt": "b", "max_tokens": 1}).status_code == 200


def test_not_ready_while_loading_then_ready():
    gate = threading.Event()
    engine = FakeEngine()

    def slow_factory():
        gate.wait(10)
        return engine

    server = ServerApp(AsyncEngine(slow_factory))
    with TestClient(server.app) as c:
        assert c.get("/health").status_code == 200
        r = c.get("/ready")
        assert r.status_code == 503 and r.json()["state"] == "loading"
        r = c.post("/v1/completions", json={"prompt": "a"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
        assert c.get("/v1/models").status_code == 503
        gate.set()
        wait_for(lambda: c.get("/ready").status_code == 200)
        assert c.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}).status_code == 200


def test_failed_engine_load_reports_unhealthy():
    def broken():
        raise RuntimeError("weights missing")

    server = ServerApp(AsyncEngine(broken))
    with TestClient(server.app) as c:
        wait_for(lambda: server.aengine.state is ServerState.FAILED)
        assert c.get("/health").status_code == 503
        r = c.post("/v1/completions", json={"prompt": "a"})
        assert r.status_code == 500 and "weights missing" in r.json()["error"]["message"]


def test_draining_refuses_new_requests_and_lets_inflight_finish():
    engine = FakeEngine(step_delay_s=0.02)
    c, server = make_client(engine)
    with c:
        wait_for(lambda: c.get("/ready").status_code == 200)
        got: list = []

        def stream() -> None:
            with c.stream("POST", "/v1/completions", json={"prompt": "a", "max_tokens": 50, "stream": True}) as r:
                got.extend(_events(r))

        t = threading.Thread(target=stream)
        t.start()
        wait_for(lambda: engine.generation_tokens >= 2)
        c.portal.call(server.aengine.begin_drain)
        assert c.get("/ready").status_code == 503
        refused = c.post("/v1/completions", json={"prompt": "a"})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        assert engine.generation_tokens < 50  # the stream was still running when the drain began
        t.join(30)
        assert got[-1] == "[DONE]" and got[-2]["choices"][0]["finish_reason"] == "length"
        assert "".join(e["choices"][0]["text"] for e in got[:-1]) == expected_text(TOK.encode("a"), 50)
        assert c.portal.call(server.aengine.wait_idle, 1.0) is True


# ---- metrics ------------------------------------------------------------------------------------------


def test_metrics_after_requests(client, engine):
    for _ in range(3):
        client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 4})
    m = parse_samples(client.get("/metrics").text)
    assert sample_value(m, "kvmesh_requests_finished_total", finish_reason="length") == 3
    assert sample_value(m, "kvmesh_time_to_first_token_seconds_count") == 3
    assert sample_value(m, "kvmesh_e2e_request_latency_seconds_count") == 3
    assert sample_value(m, "kvmesh_time_per_output_token_seconds_count") == 3
    assert sample_value(m, "kvmesh_inter_token_latency_seconds_count") == 9  # 3 gaps per 4-token request
    assert sample_value(m, "kvmesh_event_loop_lag_seconds_count") >= 4  # once per step with outputs
    assert sample_value(m, "kvmesh_generation_tokens_total") == engine.generation_tokens == 12
    assert sample_value(m, "kvmesh_prompt_tokens_total") == 9
    assert sample_value(m, "kvmesh_server_ready") == 1.0
    assert sample_value(m, "vllm:num_requests_running") == 0
    assert sample_value(m, "vllm:kv_cache_usage_perc") == 0.0
    assert sample_value(m, "vllm:cache_config_info", block_size="4", num_gpu_blocks="32") == 1.0
    assert sample_value(m, "kvmesh_kv_cache_usage_ratio", tier="gpu") == 0.0


def test_each_app_has_its_own_registry():
    a = ServerApp(AsyncEngine(FakeEngine), None)
    b = ServerApp(AsyncEngine(FakeEngine), None)
    a.metrics.count_error("x")
    assert a.metrics.registry is not b.metrics.registry
    ma = parse_samples(render(a.metrics.registry)[0].decode())
    mb = parse_samples(render(b.metrics.registry)[0].decode())
    assert sample_value(ma, "kvmesh_request_errors_total", code="x") == 1.0
    assert sample_value(mb, "kvmesh_request_errors_total", code="x") is None
