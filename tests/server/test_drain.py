"""Backpressure and SIGTERM draining of a real `kvmesh serve` process (default model, fp32)."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests.support.processes import ServerProcess

pytestmark = pytest.mark.slow  # a real server process and the default model

MAX_WAITING = 4
LONG_TOKENS = 40


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess("--dtype", "float32", "--max-waiting-requests", str(MAX_WAITING),
                         "--drain-timeout", "300").start()
    yield proc
    proc.stop()


def _chat_body(**kw) -> dict:
    return {"messages": [{"role": "user", "content": "Tell me a story about a lighthouse."}], "temperature": 0,
            **kw}


def test_queue_full_is_429_with_retry_after(server):
    r = httpx.post(server.url("/v1/chat/completions"), json=_chat_body(max_tokens=2, n=MAX_WAITING + 1), timeout=60)
    assert r.status_code == 429
    err = r.json()["error"]
    assert err["code"] == "queue_full" and err["type"] == "rate_limit_error"
    assert int(r.headers["retry-after"]) >= 1
    ok = httpx.post(server.url("/v1/chat/completions"), json=_chat_body(max_tokens=2, n=MAX_WAITING), timeout=600)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == MAX_WAITING


def test_sigterm_drains_inflight_stream_then_exits_zero(server):
    """SIGTERM mid-generation: not ready, new requests 503, the stream completes, exit code 0."""
    events: list = []
    first_token = threading.Event()

    def stream() -> None:
        body = _chat_body(max_tokens=LONG_TOKENS, ignore_eos=True, stream=True,
                          stream_options={"include_usage": True})
        with httpx.stream("POST", server.url("/v1/chat/completions"), json=body, timeout=600) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
                if payload != "[DONE]" and events[-1]["choices"] and events[-1]["choices"][0]["delta"].get("content"):
                    first_token.set()

    t = threading.Thread(target=stream)
    t.start()
    assert first_token.wait(300)
    server.signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    while httpx.get(server.url("/ready"), timeout=10).status_code != 503:
        assert time.monotonic() < deadline, "readiness did not turn false"
        time.sleep(0.05)
    refused = httpx.post(server.url("/v1/chat/completions"), json=_chat_body(max_tokens=2), timeout=30)
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "shutting_down"
    assert httpx.get(server.url("/health"), timeout=10).status_code == 200  # alive while draining
    assert t.is_alive(), "the stream ended before the drain could be observed"
    t.join(600)
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"]["completion_tokens"] == LONG_TOKENS  # generated to the end
    finals = [e for e in events[:-2] if e["choices"][0]["finish_reason"]]
    assert [f["choices"][0]["finish_reason"] for f in finals] == ["length"]
    assert server.wait(timeout=120) == 0
    assert "draining" in server.log_tail(200)
