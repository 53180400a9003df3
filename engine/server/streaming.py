"""Client-disconnect detection and the server-sent-events response.

A client that goes away must free its KV blocks at once, not when the next
token fails to send (a queued request sends nothing for a long time). So both
response paths run a watcher on the ASGI `receive` channel that fires an
abort callback on `http.disconnect`, and the event stream closes its body
iterator explicitly (its `finally` releases the request) instead of leaving
that to garbage collection.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send


def watch_disconnect(receive: Receive, on_disconnect: Callable[[], None]) -> asyncio.Task:
    """A task that calls `on_disconnect` when the client disconnects; cancel it when done.

    Call only after the request body has been read: the watcher consumes
    every further message of the connection.
    """

    async def watch() -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                on_disconnect()
                return

    return asyncio.ensure_future(watch())


class EventStreamResponse(Response):
    """A response streaming `events` as text/event-stream.

    `on_disconnect` runs as soon as the client goes away; the iterator is
    always closed (`aclose`) before this response returns.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_disconnect: Callable[[], None],
                 headers: dict[str, str] | None = None) -> None:
        self.events = events
        self.on_disconnect = on_disconnect
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = watch_disconnect(receive, self.on_disconnect)
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            # The client is gone (servers on ASGI spec >= 2.4 raise on send).
            self.on_disconnect()
        finally:
            watcher.cancel()
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()
