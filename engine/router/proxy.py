"""One attempt to serve a generation request on one engine, and the ASGI sends that go with it.

The rule that makes retries safe: nothing is sent to the client before the engine has produced
a first body chunk (streaming) or its whole body (non-streaming). Until then any failure
(refused connection, 503/429, connection lost) is reported as ``Retry`` and the caller may
send the request to another engine; after it, failures end the stream in-band with an OpenAI
error event and ``data: [DONE]``, so a client never hangs on a dead engine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec

from kvmesh.engine.api import errors
from kvmesh.engine.api.auth import Credentials
from kvmesh.engine.api.errors import APIError
from kvmesh.engine.api.params import STATE_HINTS_HEADER
from kvmesh.engine.router.slo import token_events

Send = Callable[[dict[str, Any]], Awaitable[None]]

RETRY_STATUSES = frozenset({429, 502, 503, 504})
"""Upstream answers that mean "this engine cannot take it now": try another one."""
# Hop-by-hop and framing headers are the proxy's own business on each side; state hints are the
# router's to give (engine/router/app.py), never a client's.
_DROP_REQUEST_HEADERS = frozenset({b"host", b"content-length", b"connection", b"keep-alive", b"transfer-encoding",
                                   b"accept-encoding", b"upgrade", b"te", b"proxy-connection",
                                   STATE_HINTS_HEADER.encode()})
_KEEP_RESPONSE_HEADERS = frozenset({"content-type", "retry-after", "x-request-id"})
SSE_DONE = b"data: [DONE]\n\n"
_json = msgspec.json.Decoder()
_encode = msgspec.json.Encoder().encode
UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)


@dataclass(frozen=True)
class Retry:
    """The attempt failed before any byte reached the client."""

    reason: str  # "connect", "status", "disconnect": a metrics label
    detail: str
    engine_down: bool  # refused/lost connection or 503: take the engine out
    status: int = 0
    body: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()


@dataclass(frozen=True)
class Done:
    """The attempt answered the client (``status`` as sent; ``outcome`` a metrics label)."""

    status: int
    outcome: str
    cached_tokens: int | None = None


@dataclass
class Hooks:
    """Called by an attempt as the response progresses (accounting and metrics).

    ``first_token`` is called once, when the first body chunk that completes an event carrying
    generated tokens arrives (a non-streamed body: with ``first_byte``): a chat stream's opening
    role-only event comes before the engine has prefilled anything, so only this marks the end
    of the request's prefill. Finding it costs one ``bytes.count`` scan per chunk up to it, none
    after.
    """

    first_byte: Callable[[float], None]  # seconds from dispatch to the first upstream body byte
    engine_failed: Callable[[str], None]
    first_token: Callable[[], None] = lambda: None


def forward_headers(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in raw if k.lower() not in _DROP_REQUEST_HEADERS}


def internal_auth(credentials: Credentials) -> tuple[Any, ...]:
    """The router session's client middleware: with an internal token, every request to an
    engine (relayed, probe, snapshot, tokenizer) carries it in place of the client's credential,
    so a client key never reaches an engine and the engines trust the router alone. Without one
    the client's ``Authorization`` passes through (engines that check keys themselves)."""
    if credentials.token is None:
        return ()

    async def add_token(req: aiohttp.ClientRequest, handler: Any) -> aiohttp.ClientResponse:
        req.headers["Authorization"] = f"Bearer {credentials.internal_token()}"
        return await handler(req)

    return (add_token,)


def response_headers(resp: aiohttp.ClientResponse, length: int | None) -> list[tuple[bytes, bytes]]:
    out = [(k.lower().encode(), v.encode("latin-1")) for k, v in resp.headers.items()
           if k.lower() in _KEEP_RESPONSE_HEADERS]
    if length is not None:
        out.append((b"content-length", str(length).encode()))
    return out


def cached_tokens_of(usage_json: bytes) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of a response body or SSE event, if present."""
    try:
        doc = _json.decode(usage_json)
        return int(doc["usage"]["prompt_tokens_details"]["cached_tokens"])
    except (msgspec.DecodeError, KeyError, TypeError, ValueError):
        return None


def usage_in_chunk(chunk: bytes) -> int | None:
    """Cached tokens from the usage event inside one SSE chunk (found by a substring search,
    so ordinary token chunks cost one C-level scan and no parsing)."""
    if b'"cached_tokens"' not in chunk:
        return None
    for event in chunk.split(b"\n\n"):
        if b'"cached_tokens"' in event and event.startswith(b"data: "):
            return cached_tokens_of(event[6:])
    return None


async def send_json(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": hdrs + list(headers or [])})
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, err: APIError) -> None:
    extra = [(k.lower().encode(), v.encode()) for k, v in (err.headers or {}).items()]
    await send_json(send, err.status, _encode(err.body()), extra)


def all_engines_down(tried: list[str]) -> APIError:
    detail = f"; tried: {'; '.join(tried)}" if tried else ""
    return APIError(f"no engine is available to serve this request{detail}. Retry shortly.", 503,
                    "service_unavailable", "no_engine_available", None, {"Retry-After": "1"})


def shedding() -> APIError:
    return APIError("every engine is at its request limit (--shed-above-running); retry shortly.", 429,
                    "rate_limit_exceeded", "engines_saturated", None, {"Retry-After": "1"})


def sse_error(err: APIError) -> bytes:
    return b"data: " + _encode(err.body()) + b"\n\n" + SSE_DONE


async def attempt(session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str],
                  send: Send, hooks: Hooks, timeout: aiohttp.ClientTimeout,
                  retry_statuses: frozenset[int] = RETRY_STATUSES) -> Retry | Done:
    """POST ``body`` to ``url`` and relay the answer to ``send`` (see the module doc).

    An answer with a status in ``retry_statuses`` is returned as ``Retry`` (with its body)
    instead of relayed, so the caller decides what the client sees.

    Cancelling the task that runs this (the client went away) closes the upstream connection,
    which the engine takes as a disconnect and aborts the request.
    """
    start = time.perf_counter()
    try:
        resp = await session.post(url, data=body, headers=headers, timeout=timeout)
    except UPSTREAM_ERRORS as e:
        return Retry("connect", f"{type(e).__name__}: {e}", engine_down=True)
    complete = False
    try:
        if resp.status in retry_statuses:
            data = await resp.read()
            complete = True
            return Retry("status", f"HTTP {resp.status}", engine_down=resp.status == 503, status=resp.status,
                         body=data, headers=tuple(response_headers(resp, None)))
        if not resp.headers.get("content-type", "").startswith("text/event-stream"):
            try:
                data = await resp.read()
            except UPSTREAM_ERRORS as e:
                return Retry("disconnect", f"{type(e).__name__}: {e}", engine_down=True)
            complete = True
            hooks.first_byte(time.perf_counter() - start)
            hooks.first_token()
            await send({"type": "http.response.start", "status": resp.status,
                        "headers": response_headers(resp, len(data))})
            await send({"type": "http.response.body", "body": data})
            cached = cached_tokens_of(data) if resp.status == 200 else None
            return Done(resp.status, "ok" if resp.status < 400 else
                        "client_error" if resp.status < 500 else "upstream_error", cached)
        return await _relay_stream(resp, send, hooks, start)
    finally:
        if complete:
            resp.release()
        else:
            resp.close()  # drop the connection: the engine sees the client gone and aborts


async def _relay_stream(resp: aiohttp.ClientResponse, send: Send, hooks: Hooks, start: float) -> Retry | Done:
    try:
        first = await resp.content.readany()
    except UPSTREAM_ERRORS as e:
        return Retry("disconnect", f"{type(e).__name__}: {e}", engine_down=True)
    if not first:
        return Retry("disconnect", "the engine closed the stream before its first event", engine_down=True)
    hooks.first_byte(time.perf_counter() - start)
    waiting_token = not token_events(first)
    if not waiting_token:
        hooks.first_token()
    await send({"type": "http.response.start", "status": resp.status, "headers": response_headers(resp, None)})
    await send({"type": "http.response.body", "body": first, "more_body": True})
    cached = usage_in_chunk(first)
    try:
        async for chunk in resp.content.iter_any():
            if waiting_token and token_events(chunk):
                waiting_token = False
                hooks.first_token()
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if cached is None:
                cached = usage_in_chunk(chunk)
    except UPSTREAM_ERRORS as e:
        hooks.engine_failed(f"stream broke: {type(e).__name__}: {e}")
        err = errors.APIError("the engine serving this request failed mid-stream; retry the request",
                              502, "server_error", "upstream_failed")
        await send({"type": "http.response.body", "body": sse_error(err)})
        return Done(resp.status, "failed_midstream")
    await send({"type": "http.response.body", "body": b""})
    return Done(resp.status, "ok" if resp.status < 400 else "client_error", cached)
