"""A minimal HTTP endpoint for probes, served from the operator's event loop.

    GET /healthz  200 while the event loop runs (liveness)
    GET /readyz   200 once the process is up, leader or standby (readiness:
                  a standby must count as ready or a rolling update of a
                  multi-replica operator would never finish)
    GET /leader   200 {"leader": true, ...} on the replica that reconciles,
                  503 {"leader": false, ...} on a standby
    GET /metrics  the operator's Prometheus metrics (metrics.py), when
                  HealthState.metrics is set; a standby's are empty, since
                  only the leader runs the autoscaler

It answers from the same loop that runs the operator, so a wedged loop fails
liveness. Plain asyncio streams: no extra dependency, and nothing here blocks.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Callable

METRICS_PATH = "/metrics"


@dataclass
class HealthState:
    identity: str
    is_leader: Callable[[], bool] = lambda: False
    started: bool = False
    extra: dict = field(default_factory=dict)
    # Renders the metrics exposition: (body, content type). None: no /metrics.
    metrics: Callable[[], tuple[bytes, str]] | None = None


def respond(state: HealthState, path: str) -> tuple[int, dict]:
    """Status code and JSON body for a probe path (pure)."""
    path = path.split("?", 1)[0]
    leader = bool(state.is_leader())
    if path == "/healthz":
        return 200, {"ok": True}
    if path == "/readyz":
        return (200 if state.started else 503), {"ready": state.started}
    if path == "/leader":
        return (200 if leader else 503), {"leader": leader, "identity": state.identity}
    return 404, {"error": f"unknown path {path}; try /healthz, /readyz, /leader or /metrics"}


def respond_bytes(state: HealthState, path: str) -> tuple[int, str, bytes]:
    """Status code, content type and body for any path, /metrics included."""
    if state.metrics is not None and path.split("?", 1)[0] == METRICS_PATH:
        body, content_type = state.metrics()
        return 200, content_type, body
    code, payload = respond(state, path)
    return code, "application/json", json.dumps(payload).encode()


async def serve_health(state: HealthState, host: str, port: int) -> asyncio.AbstractServer:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), timeout=5)
            parts = request.decode("latin-1").split()
            code, content_type, payload = respond_bytes(state, parts[1] if len(parts) > 1 else "/")
            reason = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}[code]
            writer.write(
                f"HTTP/1.1 {code} {reason}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload
            )
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port)
