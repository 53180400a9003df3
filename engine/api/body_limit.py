"""A bound on request bodies, as ASGI middleware shared by the engine server and the router.

Invariant: no more than ``max_bytes`` of one request body is ever held. A body announced larger
(``Content-Length``) is refused before any of it is read; a chunked body is read up to the limit
and refused as soon as it passes it. Both get 413 in the OpenAI error format, and the app behind
never sees the request. A body within the limit is read whole (both apps read it whole anyway)
and handed on as one message, so the app behind reads it without another copy.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from .errors import APIError, invalid_request, request_too_large

DEFAULT_MAX_REQUEST_BYTES = 4 << 20

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return -1
    return None


class BodyLimit:
    """Wraps an ASGI app; ``on_refused(err)`` (e.g. an error counter) runs for each 413."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], max_bytes: int,
                 on_refused: Callable[[APIError], None] | None = None) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes
        self.on_refused = on_refused

    def __getattr__(self, name: str) -> Any:  # e.g. FastAPI's app.state, seen through the wrapper
        return getattr(self.app, name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None and length > self.max_bytes:
            await self._refuse(send, length)
            return
        if length == -1:
            await _send_error(send, invalid_request("Content-Length is not a number"), close=True)
            return
        parts: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":  # the client went away: nothing to answer
                return
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(send, None)
                return
            if chunk:
                parts.append(chunk)
            if not msg.get("more_body"):
                break
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        sent = False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls wait for the disconnect, as the app expects

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send, got: int | None) -> None:
        err = request_too_large(self.max_bytes, got)
        if self.on_refused is not None:
            self.on_refused(err)
        await _send_error(send, err, close=True)


async def _send_error(send: Send, err: APIError, close: bool = False) -> None:
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:  # the rest of an oversized body is never read: this connection cannot carry another request
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
