"""A real KV block server with a cache-node store on a test's loop thread (one process, real ucxx)."""

from __future__ import annotations

from kvmesh.engine.cachenode.service import CacheNodeHandler
from kvmesh.engine.cachenode.store import BlockStore
from kvmesh.engine.transfer.client import KVClient
from kvmesh.engine.transfer.loop_thread import LoopThread
from kvmesh.engine.transfer.server import KVServer


class Node:
    """A server with a store on ``loop``; ``wrap`` may wrap the real handler to inject faults;
    ``shm``: whether the server takes same-host lanes and its clients offer them."""

    def __init__(self, loop: LoopThread, capacity: int = 1 << 30, wrap=None, shm: bool = False,  # noqa: ANN001
                 client_defaults: dict | None = None, max_put: int | None = None,
                 max_inflight: int | None = None) -> None:
        self.loop = loop
        self.shm = shm
        self.client_defaults = client_defaults or {}
        self.store = BlockStore(capacity, max_inflight_bytes=max_inflight)
        real = CacheNodeHandler(self.store, payload_timeout=2.0, max_put=max_put)
        self.server = KVServer(wrap(real) if wrap else real, shm=shm)
        loop.call(self.server.start(), 10)

    def client(self, **kw) -> KVClient:
        kw = {"shm": self.shm, **self.client_defaults, **kw}
        return KVClient("127.0.0.1", self.server.port, loop=self.loop, **kw)

    def close(self) -> None:
        self.loop.call(self.server.close(), 10)
