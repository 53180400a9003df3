"""Finding and connecting to a cache node from ``HOST:PORT`` (``--cache-node`` / ``--cache-service``).

``HOST:PORT`` is the node's HTTP side port; ``HOST`` may be a headless Service name that resolves
to several cache pods. The link resolves it on a background thread, picks the lowest address
(every engine picks the same node, so blocks one engine writes are where another looks), reads
that node's ``/kv/info`` for its UCX port and builds two ``KVClient``s on one transfer loop: one
for fetches, one for write-through saves, so a large save never queues a fetch behind it.

Invariants: ``clients()`` never blocks (None until resolved, or after a failure until the next
resolve); a connect failure or a vanished peer schedules a re-resolve (the node may have
restarted, or the Service may now point elsewhere), at most once per ``retry_s``.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from ..transfer.errors import ConnectFailed, PeerGone
from ..transfer.staging import StagingPool

log = logging.getLogger("kvmesh.engine.remote")


class CacheNodeAddressError(ValueError):
    """``--cache-node`` is not HOST:PORT."""


def parse_host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise CacheNodeAddressError(f"--cache-node must be HOST:PORT (the node's HTTP port), got {text!r}")
    return host.strip("[]"), int(port)


def resolve_node(host: str, port: int, timeout: float = 2.0, token: str | None = None) -> tuple[str, int]:
    """(address, UCX port) of the node behind ``host:port``: lowest address, its /kv/info (asked
    with the deployment's internal ``token`` when there is one)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addrs = sorted({i[4][0] for i in infos})
    if not addrs:
        raise OSError(f"{host} resolves to no address")
    addr = addrs[0]
    url_host = f"[{addr}]" if ":" in addr else addr
    req = urllib.request.Request(f"http://{url_host}:{port}/kv/info",
                                 headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        info = json.loads(r.read())
    ucx_port = info.get("ucx_port")
    if not isinstance(ucx_port, int):
        raise OSError(f"cache node {addr}:{port} reports no UCX port yet (still starting?)")
    return addr, ucx_port


class CacheNodeLink:
    def __init__(self, address: str, *, timeout: float = 5.0, retry_s: float = 5.0,
                 token: Callable[[], str | None] = lambda: None, max_fetch_bytes: int = 0) -> None:
        """``token`` gives the internal token (re-read on rotation) the node's /kv/info needs.
        ``max_fetch_bytes``: the largest fetch (a longest prompt's KV); staging for fetches up to
        it is faulted in on a background thread, so a first reload lands as fast as later ones."""
        self.host, self.port = parse_host_port(address)
        self.token = token
        self.address = address
        self.timeout = timeout
        self.retry_s = retry_s
        self._lock = threading.Lock()
        self._clients: tuple[Any, Any] | None = None
        self._loop: Any = None
        self._resolving = False
        self._last_attempt = -float("inf")
        self._closed = False
        self._first = threading.Event()  # the first resolve (and its connections) finished, either way
        self.peer: str | None = None
        # Room for a longest prompt's fetch and the halves below it: a reload that misses every
        # warm buffer lands in fresh memory and pays its page faults inside the TTFT.
        self.staging = StagingPool(max_free_bytes=max(512 << 20, 2 * max_fetch_bytes))
        """Where fetches land; the remote tier hands each batch back once it is in the KV cache."""
        self._warming: threading.Thread | None = None
        if max_fetch_bytes:
            self._warming = threading.Thread(target=self.staging.warm, args=(max_fetch_bytes,),
                                             name="kvmesh-staging-warm", daemon=True)
            self._warming.start()
        self.resolve_async()

    def wait_first(self, timeout: float) -> bool:
        """Wait (at most ``timeout``) for the first resolve, its warm connections and the warm staging
        buffers: an engine that starts beside a running node is ready with them, so its first
        request is a reload at full speed, not a recompute behind a connect. True when linked."""
        deadline = time.monotonic() + timeout
        self._first.wait(timeout)
        if self._warming is not None:  # its page faults would otherwise land beside the first reload
            self._warming.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            return self._clients is not None

    def clients(self) -> tuple[Any, Any] | None:
        with self._lock:
            clients = self._clients
        if clients is None:
            self.resolve_async()
        return clients

    def on_failure(self, exc: Exception) -> None:
        """A transfer failed: re-resolve if the node may be gone or restarted elsewhere."""
        if isinstance(exc, (ConnectFailed, PeerGone)):
            self.resolve_async(force=True)

    def resolve_async(self, force: bool = False) -> None:
        with self._lock:
            now = time.monotonic()
            if self._closed or self._resolving or now - self._last_attempt < self.retry_s:
                return
            if self._clients is not None and not force:
                return
            self._resolving = True
            self._last_attempt = now
        threading.Thread(target=self._resolve, name="kvmesh-cache-node-resolve", daemon=True).start()

    def _resolve(self) -> None:
        try:
            self._link()
        finally:
            self._first.set()

    def _link(self) -> None:
        try:
            addr, ucx_port = resolve_node(self.host, self.port, timeout=min(2.0, self.timeout), token=self.token())
        except (OSError, urllib.error.URLError, ValueError) as e:
            log.warning("cache node %s unreachable (%s); requests recompute until it is back", self.address, e)
            with self._lock:
                self._resolving = False
            return
        from ..transfer.client import KVClient
        from ..transfer.loop_thread import shared_loop

        with self._lock:
            if self._closed:
                self._resolving = False
                return
            if self._loop is None:
                self._loop = shared_loop()
            old, same = self._clients, self.peer == f"{addr}:{ucx_port}"
            fresh = None
            if not same or old is None:
                self._clients = (KVClient(addr, ucx_port, loop=self._loop, max_pending=64, max_connections=2,
                                          timeout=self.timeout, connect_timeout=min(2.0, self.timeout), token=self.token,
                                          staging=self.staging),
                                 KVClient(addr, ucx_port, loop=self._loop, max_pending=8, max_connections=1,
                                          timeout=self.timeout, connect_timeout=min(2.0, self.timeout), token=self.token))
                self.peer = f"{addr}:{ucx_port}"
                fresh = self._clients
                log.info("cache node %s: UCX %s", self.address, self.peer)
            else:
                old = None
            self._resolving = False
        if old is not None:
            for c in old:
                c.close(timeout=1.0)
        if fresh is not None:
            self._warm(fresh)

    def _warm(self, clients: tuple[Any, Any]) -> None:
        """One connection of each client opened now (the fetch's and the save's)."""
        from ..transfer.errors import TransferError

        futs = [c.warm(1) for c in clients]
        for f in futs:
            try:
                f.result(self.timeout + 1.0)
            except (TransferError, OSError, TimeoutError) as e:  # the first request connects (or fails) itself
                log.warning("cache node %s: no connection yet (%s: %s)", self.address, type(e).__name__, e)
                return

    def close(self) -> None:
        with self._lock:
            self._closed = True
            clients, self._clients = self._clients, None
            self._loop = None  # the process's shared transfer loop: not ours to close
        for c in clients or ():
            c.close(timeout=2.0)
