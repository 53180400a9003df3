"""An upstream that costs nothing, so that what a benchmark measures in front of it is the
router's own cost: the slice of the engine's HTTP API the router calls (/ready, /metrics,
/kv/info, /v1/models, completions and chat), answered at once without a model. A stream is
``chunks`` token events, ``interval_s`` apart (each its own upstream read), then usage and
[DONE], written the way the engine writes them."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from kvmesh.engine.block_hash import extra_key
from kvmesh.engine.util.asgi import read_body

EXTRA = extra_key("null-model", "bfloat16")  # the extra key /kv/info reports (block size 16)


async def _send(send: Any, status: int, body: bytes, ctype: bytes = b"application/json") -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", ctype)]})
    await send({"type": "http.response.body", "body": body})


@dataclass
class NullEngine:
    chunks: int = 3
    interval_s: float = 0.0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/ready":
            return await _send(send, 200, b'{"ready":true,"state":"ready","engine_id":"null"}')
        if path == "/metrics":
            return await _send(send, 200, b"kvmesh_num_requests_running 0\nkvmesh_num_requests_waiting 0\n",
                               b"text/plain")
        if path == "/kv/info":
            return await _send(send, 200, json.dumps({"engine_id": "null", "block_size": 16,
                                                      "hash_function": "sha256", "extra_key": EXTRA.hex(),
                                                      "kv_events": None}).encode())
        if path.startswith("/v1/models"):
            return await _send(send, 200, b'{"object":"list","data":[{"id":"null-model"}]}')
        body = await read_body(receive)
        req = json.loads(body or b"{}")
        usage = {"prompt_tokens": 2, "completion_tokens": self.chunks, "total_tokens": 2 + self.chunks}
        if not req.get("stream"):
            return await _send(send, 200, json.dumps({"object": "text_completion", "model": "null-model",
                                                      "choices": [{"index": 0, "text": "x"}],
                                                      "usage": usage}).encode())
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(self.chunks):
            event = json.dumps({"choices": [{"index": 0, "text": f"t{i}"}]}, separators=(",", ":"))
            await send({"type": "http.response.body", "body": f"data: {event}\n\n".encode(), "more_body": True})
            if self.interval_s:
                await asyncio.sleep(self.interval_s)
        tail = json.dumps({"choices": [], "usage": usage}, separators=(",", ":"))
        await send({"type": "http.response.body", "body": f"data: {tail}\n\ndata: [DONE]\n\n".encode()})
