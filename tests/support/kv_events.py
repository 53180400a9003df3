"""KV event fixtures: a snapshot HTTP server and random, self-consistent event streams."""

from __future__ import annotations

import contextlib
import json
import random
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kvmesh.engine.kv.event_publisher import KVEventPublisher
from kvmesh.engine.kv.event_wire import snapshot_to_json
from kvmesh.engine.util.localproc import free_port_pair
from kvmesh.engine.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventLog


class SnapshotServer:
    """Serves ``GET /kv/snapshot`` for whatever log ``self.log`` names (swap it to fake a restart)."""

    def __init__(self, log: KVEventLog) -> None:
        self.log = log
        self.requests = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                outer.requests += 1
                if self.path != "/kv/snapshot":
                    self.send_error(404)
                    return
                body = json.dumps(snapshot_to_json(outer.log.snapshot())).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}/kv/snapshot"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def __enter__(self) -> SnapshotServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


@contextlib.contextmanager
def published_log(engine_id: str, token: str | None = None) -> Iterator[
        tuple[KVEventLog, KVEventPublisher, SnapshotServer]]:
    """A log, a real publisher streaming it on free loopback ports (CURVE with ``token``) and its
    snapshot route: what an engine's KV events look like from outside."""
    log = KVEventLog(engine_id, capacity=10_000)
    pub = KVEventPublisher("127.0.0.1", free_port_pair(), token=token)
    with SnapshotServer(log) as snap:
        pub.start(log)
        try:
            yield log, pub, snap
        finally:
            pub.close()


def _h(rng: random.Random) -> bytes:
    return rng.randbytes(32)


class RandomCache:
    """Random but self-consistent events: stores new chains, removes cached blocks, rarely clears."""

    def __init__(self, seed: int, block_size: int = 4) -> None:
        self.rng = random.Random(seed)
        self.block_size = block_size
        self.cached: list[bytes] = []

    def next_event(self) -> KVEvent:
        rng = self.rng
        r = rng.random()
        if r < 0.01:
            self.cached.clear()
            return AllBlocksCleared()
        if r < 0.45 and self.cached:
            gone = rng.sample(self.cached, rng.randint(1, min(4, len(self.cached))))
            self.cached = [h for h in self.cached if h not in gone]
            return BlockRemoved(gone)
        new = [_h(rng) for _ in range(rng.randint(1, 4))]
        parent = rng.choice(self.cached) if self.cached and rng.random() < 0.5 else None
        self.cached.extend(new)
        tokens = [rng.randrange(1000) for _ in range(len(new) * self.block_size)]
        return BlockStored(new, parent, tokens, self.block_size)


def publish_random(log: KVEventLog, n: int, seed: int) -> None:
    cache = RandomCache(seed)
    for _ in range(n):
        log.publish(cache.next_event())

