"""Fuzzed OpenAI request bodies against the engine's HTTP layer and the router's prompt analysis.

Real: the server app (routing, body limit, pydantic models, the parameter checks of api/params.py,
the OpenAI error shapes, streaming) over the fake step engine, whose own checks mirror the real
engine's (tests/support/fake_step_engine.py); and the router's ``analyze`` and ``with_cache_salt``
with the fake tokenizer. What it proves: no body, valid or not, makes a 500 or an unhandled
exception, every refusal is a 4xx in OpenAI's shape with a message, and the server still answers
afterwards with nothing left in flight.
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings, strategies as st

from kvmesh.engine.router.prompt import CHAT, COMPLETIONS, analyze, with_cache_salt
from kvmesh.engine.server.app import ServerApp
from kvmesh.engine.server.async_engine import AsyncEngine

from tests.support.fake_step_engine import FakeEngine, FakeTokenizer
from tests.support.fuzz_json import JSON, SCHEMA, SMALL_INT
from tests.support.waits import wait_for

MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "robot"]) | JSON},
                                optional={"content": st.text(max_size=30) | JSON, "name": JSON,
                                          "tool_calls": st.lists(st.fixed_dictionaries({"function": st.fixed_dictionaries(
                                              {"name": st.text(max_size=4)}, optional={"arguments": st.text(max_size=8)
                                                                                      | JSON})}) | JSON, max_size=2)
                                          | JSON})
FIELDS = {
    "model": st.sampled_from(["fake-model", "other"]) | JSON,
    "prompt": st.text(max_size=30) | st.lists(st.integers(-5, 400), max_size=8) | JSON,
    "messages": st.lists(MESSAGE, max_size=3) | JSON,
    "max_tokens": SMALL_INT | JSON, "max_completion_tokens": SMALL_INT | JSON,
    "n": SMALL_INT, "temperature": st.floats(-1, 3) | JSON, "top_p": st.floats(-1, 2) | JSON,
    "top_k": SMALL_INT | JSON, "min_p": st.floats(-1, 2) | JSON, "seed": SMALL_INT | JSON,
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=20) | JSON,
    "stop_token_ids": st.lists(st.integers(-5, 400), max_size=4) | JSON,
    "logprobs": SMALL_INT | st.booleans() | JSON, "top_logprobs": SMALL_INT | JSON,
    "stream": st.booleans() | JSON, "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | JSON,
    "logit_bias": st.dictionaries(st.text(max_size=4), st.floats(-200, 200), max_size=3) | JSON,
    "presence_penalty": st.floats(-3, 3) | JSON, "frequency_penalty": st.floats(-3, 3) | JSON,
    "echo": st.booleans() | JSON, "ignore_eos": st.booleans() | JSON, "priority": SMALL_INT | JSON,
    "cache_salt": st.text(max_size=300) | JSON, "user": JSON,
    "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": st.sampled_from(["f", "get_weather", "bad name", ""]) | st.text(max_size=6)},
        optional={"parameters": SCHEMA, "description": st.text(max_size=8) | JSON})}) | JSON, max_size=3) | JSON,
    "tool_choice": st.sampled_from(["none", "auto", "required"]) | st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g"])})}) | JSON,
    "parallel_tool_calls": st.booleans() | JSON,
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema"])},
                                             optional={"json_schema": st.fixed_dictionaries({"schema": SCHEMA})})
    | JSON,
    "kv_transfer_params": st.fixed_dictionaries({"transfer_id": st.text(max_size=5)}) | JSON,
    "best_of": SMALL_INT | JSON, "suffix": JSON,
    "repetition_penalty": st.floats(-1, 3) | JSON, "prompt_logprobs": SMALL_INT | JSON, "min_tokens": SMALL_INT | JSON,
    "allowed_token_ids": st.lists(st.integers(-5, 400), max_size=4) | JSON,
    "bad_words": st.lists(st.text(max_size=6), max_size=3) | JSON,
    "guided_json": SCHEMA | st.text(max_size=20) | JSON, "guided_regex": st.text(max_size=12) | JSON,
    "guided_choice": st.lists(st.text(max_size=5), max_size=3) | JSON, "guided_grammar": st.text(max_size=20) | JSON,
    "structured_outputs": st.dictionaries(st.sampled_from(["json", "regex", "choice", "grammar", "json_object"]),
                                          SCHEMA | st.text(max_size=8) | JSON, max_size=2) | JSON,
}
BASES = {"/v1/completions": {"model": "fake-model", "prompt": "hello there", "max_tokens": 3},
         "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}}


@st.composite
def requests(draw) -> tuple[str, bytes]:
    """Mostly a valid request with a few fields changed or added; sometimes any JSON or any bytes."""
    path = draw(st.sampled_from(sorted(BASES)))
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return path, json.dumps(draw(JSON)).encode()
    if kind == 1:
        return path, draw(st.binary(max_size=64))
    body = dict(BASES[path])
    for name in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=3, unique=True)):
        body[name] = draw(FIELDS[name])
    return path, json.dumps(body).encode()


BODIES = requests().map(lambda pb: pb[1])


@pytest.fixture(scope="module")
def client():
    engine = FakeEngine()
    c = TestClient(ServerApp(AsyncEngine(lambda: engine), ["fake-model"]).app)
    with c:
        wait_for(lambda: c.get("/ready").status_code == 200)
        yield c, engine
    engine.running.set()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(request=requests())
def test_no_body_makes_the_engine_fail(client, request):
    c, engine = client
    path, body = request
    r = c.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["message"] and err["type"], err
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
    else:
        assert r.json()["choices"] is not None
    assert c.get("/health").status_code == 200
    wait_for(lambda: not engine.has_unfinished_requests(), timeout=5)  # nothing left behind in the engine


@settings(max_examples=300, deadline=None)
@given(path=st.sampled_from([COMPLETIONS, CHAT, "/v1/other"]), body=BODIES, salt=st.none() | st.text(max_size=20))
def test_the_router_analyses_any_body_without_raising(path, body, salt):
    """Analysis never rejects: a body the router cannot read is routed without prefix information
    and the engine answers it. Rewriting the salt keeps a JSON object a JSON object."""
    salted = with_cache_salt(body, lambda own: salt)
    info = analyze(path, salted, FakeTokenizer())
    assert info.token_ids is None or all(isinstance(t, int) for t in info.token_ids)
    info.hashes(4, b"extra")
    if salted is not body:
        assert json.loads(salted)["cache_salt"] == salt
