"""One cache-node process: the block store behind a ucxx listener, an HTTP side port, KV events.

Start order fails fast: the KV event sockets and the HTTP port bind before anything listens for
blocks, so a port clash is reported at once. Shutdown order: stop accepting and abort transfer
connections, then the event publisher, then the HTTP port. The store is memory only: a restarted
node is empty, and clients see misses.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from dataclasses import dataclass, field
from typing import Any

from kvmesh.engine.block_hash import ROOT_HASH
from ..api.auth import Credentials
from ..kv.event_publisher import KVEventPublisher
from ..kv.event_wire import topic_for
from ..kv.events import TIER_REMOTE, KVEventLog
from ..transfer.server import KVServer
from ..transfer.ucx_env import stop_ucx_notifier
from .http import SidePort
from .service import CacheNodeHandler
from .store import BlockStore

log = logging.getLogger("kvmesh.cachenode")


@dataclass(frozen=True)
class NodeSettings:
    memory: int
    """KV capacity in bytes: stored blocks never exceed it (blocks in flight are ``max_inflight``)."""
    host: str = "0.0.0.0"
    """Address of the HTTP side port (the UCX listener binds every interface)."""
    port: int = 8000
    """HTTP side port; 0 picks a free one."""
    ucx_port: int = 8001
    """UCX listener port; 0 picks a free one."""
    node_id: str = ""
    """Name in KV events and /kv/info (default: the host name)."""
    kv_events_port: int = 0
    """ZeroMQ PUB port for KV events (replay on +1); 0 publishes nothing."""
    kv_events_host: str = ""
    payload_timeout: float = 60.0
    """How long a put's payloads may take to arrive before its reservations are given back."""
    message_timeout: float = 30.0
    """How long a request's rest (or a connection's hello) may take once it started."""
    max_inflight: int | None = None
    """Bytes of offered blocks not yet arrived, all connections together (None: ``memory``)."""
    max_put: int | None = None
    """Bytes one put may reserve (one connection's share; None: no limit but ``max_inflight``)."""
    auth: Credentials = field(default_factory=Credentials)
    """--auth-token-file: the internal token the UCX port and the HTTP side port's /kv/* routes need."""


class CacheNode:
    def __init__(self, settings: NodeSettings) -> None:
        self.settings = settings
        self.node_id = settings.node_id or socket.gethostname()
        self.events = KVEventLog(self.node_id)
        self.store = BlockStore(settings.memory, on_event=self.events.publish, max_inflight_bytes=settings.max_inflight)
        self.handler = CacheNodeHandler(self.store, payload_timeout=settings.payload_timeout, max_put=settings.max_put,
                                        extra_stats=lambda: {"node_id": self.node_id,
                                                             "connections": self.server.open_connections})
        self.server = KVServer(self.handler, settings.ucx_port, host=settings.host, token=settings.auth.internal_token,
                               message_timeout=settings.message_timeout)
        self.publisher = (KVEventPublisher(settings.kv_events_host or settings.host, settings.kv_events_port,
                                           token=settings.auth.internal_token())
                          if settings.kv_events_port else None)
        self.http: SidePort | None = None
        self.ready = False

    def info(self) -> dict[str, Any]:
        """``/kv/info``: the engines' shape, for a node that holds blocks of any model.

        ``block_size``/``extra_key`` are null: a cache node does not hash prompts, it stores
        whatever blocks engines put (their headers carry the geometry).
        """
        pub = self.publisher
        return {
            "engine_id": self.node_id,
            "role": "cache-node",
            "block_size": None,
            "hash_function": "sha256",
            "root_hash": ROOT_HASH.hex(),
            "extra_key": None,
            "kv_events": None if pub is None else {"port": pub.port, "replay_port": pub.replay_port,
                                                   "topic": topic_for(self.node_id).decode()},
            "tiers": [TIER_REMOTE],
            "ucx_port": self.server.port if self.ready else None,
            "capacity_bytes": self.store.capacity_bytes,
        }

    async def start(self) -> None:
        if self.publisher is not None:
            self.publisher.bind()
        s = self.settings
        self.http = SidePort(s.host, s.port, self.store, self.events, self.info, lambda: self.ready,
                             lambda: self.server.open_connections, auth=s.auth,
                             closed=lambda: {"auth_failures": self.server.auth_failures,
                                             "timeouts": self.server.timeouts})
        self.http.start()
        await self.server.start()
        if self.publisher is not None:
            self.publisher.start(self.events)
        self.ready = True
        log.info("cache node %s ready: %d bytes, HTTP %s:%d, UCX port %d%s", self.node_id, self.store.capacity_bytes,
                 s.host, self.http.port, self.server.port,
                 f", KV events on {self.publisher.endpoint}" if self.publisher else "")

    async def close(self) -> None:
        self.ready = False
        await self.server.close()
        if self.publisher is not None:
            self.publisher.close()
        if self.http is not None:
            self.http.close()


async def serve(settings: NodeSettings, stop: asyncio.Event | None = None) -> None:
    """Run a node until ``stop`` is set (or SIGTERM/SIGINT when ``stop`` is None)."""
    loop = asyncio.get_running_loop()
    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    node = CacheNode(settings)
    try:
        await node.start()
        await stop.wait()
        log.info("cache node %s stopping", node.node_id)
    finally:
        await node.close()
        stop_ucx_notifier()
