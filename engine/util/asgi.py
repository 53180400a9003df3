"""ASGI helpers: reading a request body, and an app served by uvicorn on 127.0.0.1 in a
background thread for in-process use (the tests' fake engines and routers, the benchmarks'
upstreams; real TCP, so whatever talks to it opens real connections)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn


async def read_body(receive: Callable[[], Any]) -> bytes:
    """The whole request body; a client that disconnects first cancels the caller (nothing to
    answer)."""
    parts = []
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise asyncio.CancelledError
        parts.append(msg.get("body", b""))
        if not msg.get("more_body"):
            return b"".join(parts)


class ServerThread:
    """uvicorn for ``app`` on its own thread and event loop; ``start`` returns once it listens.

    The listening socket is bound here, before the thread starts (port 0: the kernel picks a
    free one), so no other process can take the port between choosing it and listening on it.
    """

    def __init__(self, app: Any, port: int | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind(("127.0.0.1", port or 0))
        except OSError:
            self.sock.close()
            raise
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="auto",
                                loop="asyncio", http="httptools")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self, timeout: float = 30) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on port {self.port} did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()
