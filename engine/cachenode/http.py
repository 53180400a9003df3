"""The cache node's HTTP side port: ``/health``, ``/ready``, ``/metrics``, ``/kv/snapshot``, ``/kv/info``.

Plain ``http.server`` on its own threads: five read-only GET routes need no framework, and they
must keep answering while the transfer loop is busy. Everything they read is behind the store's
or the event log's lock.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..api.auth import Credentials, access_for
from ..kv.event_wire import snapshot_to_json
from ..kv.events import KVEventLog
from .store import BlockStore

log = logging.getLogger("kvmesh.cachenode")

_COUNTERS = {  # StoreStats field -> (metric name without kvmesh_cachenode_ and _total, help)
    "puts": ("puts", "Blocks stored by puts"),
    "put_duplicates": ("put_duplicates", "Offered blocks already held or in flight (not sent again)"),
    "put_refused": ("put_refused", "Offered blocks refused (larger than the budget, or no room)"),
    "put_aborted": ("put_aborted", "Offered blocks whose transfer failed (reservation given back)"),
    "lookups": ("lookups", "Lookup requests"),
    "lookup_hits": ("lookup_hit_blocks", "Blocks found by lookups (sum of prefix lengths)"),
    "gets": ("get_blocks", "Blocks asked for by gets"),
    "hits": ("hit_blocks", "Blocks served by gets"),
    "evictions": ("evictions", "Blocks evicted to make room"),
    "rejected_headers": ("rejected_headers", "Puts or gets rejected for a block header mismatch"),
    # Bytes as well as blocks: block sizes differ across models, and bytes are what load the network.
    "put_bytes": ("received_bytes", "Bytes of blocks stored by puts"),
    "hit_bytes": ("sent_bytes", "Bytes of blocks served by gets"),
}


_CLOSED = {
    "auth_failures": ("auth_failed_connections", "UCX connections closed for not proving the internal token"),
    "timeouts": ("stalled_connections", "UCX connections closed for a Hello, a request or a put's data that "
                                        "did not arrive in time (--message-timeout, --payload-timeout)"),
}


class CacheNodeCollector:
    """Prometheus collector reading the store at scrape time (no per-request metric updates)."""

    def __init__(self, store: BlockStore, connections: Callable[[], int], refused: Callable[[], int] = lambda: 0,
                 closed: Callable[[], dict[str, int]] = dict) -> None:
        """``closed()``: the transport server's counts of connections it closed, by ``_CLOSED`` key."""
        self.store = store
        self.connections = connections
        self.refused = refused
        self.closed = closed

    def collect(self) -> Iterator[Any]:
        s = self.store
        blocks, used = s.num_blocks, s.used_bytes
        gauges = [
            ("capacity_bytes", "KV capacity (--memory)", s.capacity_bytes),
            ("used_bytes", "Bytes of stored blocks", used),
            ("reserved_bytes", "Bytes reserved for puts in flight", s.reserved_bytes),
            ("blocks", "Stored blocks", blocks),
            # Blocks may differ in size across models: capacity in blocks assumes the mean stored size.
            ("capacity_blocks", "Estimated capacity in blocks (capacity / mean stored block size)",
             s.capacity_bytes * blocks // used if used else 0),
            ("connections", "Open transfer connections", self.connections()),
        ]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(f"kvmesh_cachenode_{name}", doc)
            g.add_metric([], value)
            yield g
        stats = s.stats.as_dict()
        for field, (name, doc) in _COUNTERS.items():
            c = CounterMetricFamily(f"kvmesh_cachenode_{name}", doc)
            c.add_metric([], stats[field])
            yield c
        c = CounterMetricFamily("kvmesh_cachenode_auth_refused", "HTTP requests refused for a missing or wrong "
                                                                 "internal token")
        c.add_metric([], self.refused())
        yield c
        closed = self.closed()
        for key, (name, doc) in _CLOSED.items():
            c = CounterMetricFamily(f"kvmesh_cachenode_{name}", doc)
            c.add_metric([], closed.get(key, 0))
            yield c


class SidePort:
    """Serves the routes on ``host:port`` from a daemon thread; ``close()`` stops it."""

    def __init__(self, host: str, port: int, store: BlockStore, events: KVEventLog,
                 info: Callable[[], dict[str, Any]], ready: Callable[[], bool],
                 connections: Callable[[], int], auth: Credentials | None = None,
                 closed: Callable[[], dict[str, int]] = dict) -> None:
        """``auth``: /kv/snapshot and /kv/info need its internal token (api/auth.py)."""
        auth = auth or Credentials()
        self.refused = 0
        registry = CollectorRegistry(auto_describe=False)
        registry.register(CacheNodeCollector(store, connections, lambda: self.refused, closed))
        outer = self
        routes: dict[str, Callable[[], tuple[int, str, bytes]]] = {
            "/health": lambda: _json(200, {"status": "ok"}),
            "/ready": lambda: _json(200, {"status": "ready"}) if ready() else _json(503, {"status": "starting"}),
            "/metrics": lambda: (200, CONTENT_TYPE_LATEST, generate_latest(registry)),
            "/kv/snapshot": lambda: _json(200, snapshot_to_json(events.snapshot())),
            "/kv/info": lambda: _json(200, info()),
        }

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                path = self.path.split("?", 1)[0]
                route = routes.get(path)
                err = auth.check(access_for(path), self.headers.get("Authorization"))
                if err is not None:
                    outer.refused += 1
                    status, ctype, body = _json(err.status, err.body())
                else:
                    status, ctype, body = route() if route else _json(404, {"error": f"no route {self.path}"})
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug("http: " + fmt, *args)

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, name="kvmesh-cachenode-http",
                                        daemon=True)

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        if self._thread.is_alive():
            self.server.shutdown()
        self.server.server_close()


def _json(status: int, doc: dict[str, Any]) -> tuple[int, str, bytes]:
    return status, "application/json", json.dumps(doc).encode()
