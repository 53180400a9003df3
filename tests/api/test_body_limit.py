"""The request-body bound both HTTP processes run (pure ASGI: a recording app, scripted messages).

Real: the middleware and the OpenAI error body. The processes behind it are tested with real
servers in tests/router/test_real_engines.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.engine.api.body_limit import BodyLimit

LIMIT = 100


def _run(headers: list[tuple[bytes, bytes]], chunks: list[bytes], limit: int = LIMIT):
    seen: list[bytes] = []
    sent: list[dict] = []

    async def app(scope, receive, send):
        msg = await receive()
        seen.append(msg["body"])
        assert msg["more_body"] is False
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    msgs = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    msgs.append({"type": "http.disconnect"})

    async def receive():
        return msgs.pop(0)

    async def send(m):
        sent.append(m)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}
    refused = []
    asyncio.run(BodyLimit(app, limit, on_refused=refused.append)(scope, receive, send))
    return seen, sent, refused


def _status(sent: list[dict]) -> int:
    return sent[0]["status"]


def test_a_body_within_the_limit_reaches_the_app_whole_in_one_message():
    seen, sent, refused = _run([(b"content-length", b"100")], [b"a" * 40, b"b" * 60])
    assert seen == [b"a" * 40 + b"b" * 60] and _status(sent) == 200 and not refused


def test_an_announced_oversized_body_is_refused_before_it_is_read():
    seen, sent, refused = _run([(b"content-length", b"101")], [b"x" * 101])
    assert seen == [] and _status(sent) == 413 and refused[0].code == "request_too_large"
    err = json.loads(sent[1]["body"])["error"]
    assert err["code"] == "request_too_large" and err["type"] == "invalid_request_error"
    assert "101 bytes" in err["message"] and "--max-request-bytes" in err["message"]
    assert (b"connection", b"close") in sent[0]["headers"]


def test_a_chunked_body_is_refused_as_soon_as_it_passes_the_limit():
    seen, sent, _ = _run([], [b"x" * 60, b"x" * 60, b"never read"])
    assert seen == [] and _status(sent) == 413


def test_a_bad_content_length_is_a_400():
    seen, sent, _ = _run([(b"content-length", b"12x")], [b""])
    assert seen == [] and _status(sent) == 400


def test_other_scopes_pass_through():
    calls = []

    async def app(scope, receive, send):
        calls.append(scope["type"])

    asyncio.run(BodyLimit(app, 1)({"type": "lifespan"}, None, None))
    assert calls == ["lifespan"]
    with pytest.raises(ValueError):
        BodyLimit(app, 0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=80), min_size=1, max_size=6), st.booleans())
def test_any_chunking_either_reaches_the_app_intact_or_is_refused(chunks, announce):
    body = b"".join(chunks)
    headers = [(b"content-length", str(len(body)).encode())] if announce else []
    seen, sent, _ = _run(headers, chunks)
    if len(body) <= LIMIT:
        assert seen == [body] and _status(sent) == 200
    else:
        assert seen == [] and _status(sent) == 413
