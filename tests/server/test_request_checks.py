"""Client mistakes the server must answer with a 400 naming the field, and the model names it
accepts (fake engine: only what the server decides)."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient

from kvmesh.engine.server.app import ServerApp
from kvmesh.engine.server.async_engine import AsyncEngine
from kvmesh.engine.api.errors import APIError
from kvmesh.engine.api.params import check_text

from tests.support.fake_step_engine import FakeEngine


@pytest.fixture
def client():
    engine = FakeEngine()
    c = TestClient(ServerApp(AsyncEngine(lambda: engine)).app)
    with c:
        deadline = time.monotonic() + 10
        while c.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, "server never became ready"
            time.sleep(0.01)
        yield c
    engine.running.set()


def _error(r, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "hi\ud800", "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", "hi\udfff"], "max_tokens": 1}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi\ud800"}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "s"},
                                           {"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "messages.1.content"),
])
def test_lone_surrogate_is_a_400_naming_the_field(client, path, body, param):
    # json.dumps escapes the surrogate as \\ud800, exactly what a client sends on the wire.
    err = _error(client.post(path, content=json.dumps(body), headers={"content-type": "application/json"}))
    assert err["code"] == "invalid_request" and err["param"] == param
    assert "surrogate" in err["message"]


def test_check_text_accepts_valid_unicode():
    assert check_text("naïve 😀", "prompt") == "naïve 😀"
    with pytest.raises(APIError) as e:
        check_text("a\udc80b", "prompt")
    assert e.value.param == "prompt" and "position 1" in e.value.message


def test_too_long_prompt_names_prompt_for_completions_and_messages_for_chat(client):
    err = _error(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1000}))
    assert (err["code"], err["param"]) == ("context_length_exceeded", "prompt")
    err = _error(client.post("/v1/chat/completions",
                             json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 1000}))
    assert (err["code"], err["param"]) == ("context_length_exceeded", "messages")


def test_name_the_server_was_started_with_is_an_alias(client):
    # FakeEngine runs EngineConfig(model="default") whose model calls itself "fake-model".
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["fake-model", "default"]
    assert client.get("/v1/models/default").status_code == 200
    r = client.post("/v1/completions", json={"model": "default", "prompt": "a", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["model"] == "default"
    r = client.post("/v1/completions", json={"model": "fake-model", "prompt": "a", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["model"] == "fake-model"
    assert _error(client.post("/v1/completions", json={"model": "other", "prompt": "a"}), 404)["param"] == "model"
