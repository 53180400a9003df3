"""Run the app under uvicorn with kvmesh's own signal handling.

uvicorn's default SIGTERM handling stops listening at once (new requests get
"connection refused", not a 503 the router can act on), and after shutdown it
re-raises the signal, so the process dies by SIGTERM instead of exiting 0.
`DrainingServer` replaces that:

1. first SIGTERM/SIGINT: readiness turns false and new generation requests
   get 503, while in-flight requests (streams included) run on;
2. once none is in flight, or after `drain_timeout_s` (then the rest are
   aborted and end with finish_reason "abort"), uvicorn shuts down normally;
3. the process exits 0. A second SIGINT forces an immediate exit.

The drain itself is `drain.Drainer`, the same one POST /admin/drain starts,
so a SIGTERM that arrives during an admin drain joins it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Generator
from types import FrameType
from typing import Any

import uvicorn

from kvmesh.engine.kv.event_publisher import KVEventPublisher, KVEventsBindError
from kvmesh.engine.kv.event_wire import TopicScheme
from kvmesh.engine.server.app import ServerApp
from kvmesh.engine.server.async_engine import AsyncEngine, ServerState
from kvmesh.engine.server.drain import Drainer
from kvmesh.engine.server.settings import ServeSettings

log = logging.getLogger("kvmesh.server")

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class DrainingServer(uvicorn.Server):
    """uvicorn.Server that drains on SIGTERM and exits 0 (see module doc)."""

    def __init__(self, config: uvicorn.Config, aengine: AsyncEngine, drain_timeout_s: float,
                 drainer: Drainer | None = None) -> None:
        super().__init__(config)
        self.aengine = aengine
        self.drain_timeout_s = drain_timeout_s
        # Shared with POST /admin/drain, so a SIGTERM during an admin drain joins it.
        self.drainer = drainer or Drainer(aengine, drain_timeout_s)
        self.exit_code = 0
        self._draining: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self._on_signal) for sig in _SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)
        # Unlike uvicorn we do not re-raise the signal: a drained server exits 0.

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        if self._draining is not None or self._loop is None:
            if sig == signal.SIGINT or self._loop is None:
                self.force_exit = True
                self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._start_drain, signal.Signals(sig).name)

    def _start_drain(self, why: str) -> None:
        if self._draining is None:
            self._draining = asyncio.ensure_future(self.drain(why))

    async def drain(self, why: str = "request") -> None:
        """Stop taking requests, let in-flight ones finish (bounded), then shut down."""
        await self.drainer.start(why, final=True)
        self.should_exit = True

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        self._watcher = asyncio.ensure_future(self._watch_engine())

    async def _watch_engine(self) -> None:
        """Exit non-zero if the model fails to load."""
        await self.aengine.loaded.wait()
        if self.aengine.state is ServerState.FAILED:
            log.error("engine failed to start: %s", self.aengine.failure)
            self.exit_code = 1
            self.should_exit = True
        else:
            log.info("ready: serving %s", ", ".join(self._names()))

    def _names(self) -> list[str]:
        server: ServerApp = self.config.app.state.server
        return server.served_names()


def build_server(settings: ServeSettings, engine_factory: Callable[[], Any] | None = None) -> DrainingServer:
    """The server for `settings`; `engine_factory` defaults to loading `settings.engine`."""
    if engine_factory is None:
        from kvmesh.engine.engine import LLMEngine

        cfg = settings.engine

        def engine_factory() -> Any:
            engine = LLMEngine(cfg)
            engine.map_pools()  # no step pays a page fault for a block's first write
            return engine

    aengine = AsyncEngine(engine_factory, max_waiting=settings.max_waiting_requests)
    publisher = None
    if settings.kv_events_port:
        publisher = KVEventPublisher(settings.kv_events_host, settings.kv_events_port,
                                     token=settings.auth.internal_token(),
                                     token_ids=settings.kv_events_token_ids,
                                     scheme=TopicScheme(settings.kv_events_format, settings.kv_events_pod))
        publisher.bind()  # a busy port fails here, before the model loads
    server_app = ServerApp(aengine, settings.served_model_names, kv_publisher=publisher,
                           drain_timeout_s=settings.drain_timeout_s, role=settings.role,
                           kv_transfer_port=settings.kv_transfer_port, kv_transfer_host=settings.host,
                           kv_transfer_timeout_s=settings.engine.kv_transfer_timeout,
                           kv_transfer_overlap=settings.kv_transfer_overlap,
                           kv_transfer_tail_tokens=settings.kv_transfer_tail_tokens,
                           max_request_bytes=settings.max_request_bytes, auth=settings.auth)
    app = server_app.app
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=settings.log_level,
        access_log=settings.access_log, timeout_keep_alive=settings.timeout_keep_alive_s,
        # In-flight work was drained already; this only bounds a stuck connection.
        timeout_graceful_shutdown=10, lifespan="on",
    )
    return DrainingServer(config, aengine, settings.drain_timeout_s, server_app.drainer)


def serve(settings: ServeSettings) -> int:
    """Serve until drained; return the process exit code."""
    try:
        server = build_server(settings)
    except KVEventsBindError as e:
        log.error("%s", e)
        return 2
    server.run()
    return server.exit_code
