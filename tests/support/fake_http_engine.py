"""Fake engines for the router's integration tests, and a stub KV event subscriber.

``FakeEngine`` is a plain ASGI app that speaks the slice of the engine's HTTP API the router
uses (/ready, /metrics, /kv/info, /v1/models, /v1/completions, /v1/chat/completions) with
scripted behaviours: answer normally, answer a fixed status, die before or after the first
stream chunk, or stream slowly and record that the client went away. It is served by a real
uvicorn server on 127.0.0.1 (``ServerThread``), so the router's upstream connections are real TCP
connections.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from kvmesh.engine.block_hash import extra_key
from kvmesh.engine.kv.events import KVSnapshot
from kvmesh.engine.util.asgi import read_body

EXTRA = extra_key("fake-model", "bfloat16")
BLOCK_SIZE = 4


@dataclass
class Behavior:
    mode: str = "ok"  # ok | status | die_before_first | die_midstream | slow
    status: int = 200
    body: dict[str, Any] | None = None
    chunks: int = 3
    ready: bool = True
    cached_tokens: int = 0
    chunk_interval_s: float = 0.0  # pause between stream chunks (0: as fast as the loop goes)


@dataclass
class FakeEngine:
    name: str
    behavior: Behavior = field(default_factory=Behavior)
    requests: list[dict[str, Any]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    url: str = ""
    kv_events: dict[str, Any] | None = None  # what /kv/info reports (None: publishes no events)
    engine_id: str = ""  # what /ready and /kv/info report ("": the name); a new one is a restart
    hash_function: str = "sha256"
    kv_info_delay_s: float = 0.0
    tokenizer: str | None = None  # the fingerprint /kv/info reports (None: none reported)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/ready":
            ok = self.behavior.ready
            return await json_response(send, 200 if ok else 503, {"ready": ok, "state": "ready" if ok else "loading",
                                                                  "engine_id": self.engine_id or self.name})
        if path == "/metrics":
            return await _text(send, 200, self.metrics_text())
        if path == "/kv/info":
            await asyncio.sleep(self.kv_info_delay_s)
            return await json_response(send, 200, self.kv_info())
        if path == "/kv/tokenizer":  # a fake has no tokenizer files to give
            return await json_response(send, 404, {"error": {"message": "no tokenizer here", "type": "x",
                                                             "param": None, "code": "not_found"}})
        if path.startswith("/v1/models"):
            return await json_response(send, 200, {"object": "list",
                                                   "data": [{"id": "fake-model", "owned_by": self.name}]})
        body = await read_body(receive)
        req = json.loads(body)
        self.requests.append(req)
        await self.handle(req, receive, send)

    def metrics_text(self) -> str:
        return "kvmesh_num_requests_running 0\nkvmesh_num_requests_waiting 0\n"

    def kv_info(self) -> dict[str, Any]:
        return {"engine_id": self.engine_id or self.name, "block_size": BLOCK_SIZE, "hash_function": self.hash_function,
                "extra_key": EXTRA.hex(), "kv_events": self.kv_events, "max_model_len": 4096,
                "served_model_names": ["fake-model"],
                **({"tokenizer": self.tokenizer} if self.tokenizer else {})}

    async def handle(self, req: dict[str, Any], receive: Any, send: Any) -> None:
        """Answer one generation request as ``behavior`` scripts."""
        b = self.behavior
        if b.mode == "status":
            return await json_response(send, b.status, b.body or {"error": {"message": "scripted", "type": "x",
                                                                          "param": None, "code": "scripted"}})
        if b.mode == "die_before_first":
            # Headers out, then the connection drops before any body byte (an exception before
            # the head would make uvicorn answer a clean 500 instead).
            ctype = b"text/event-stream" if req.get("stream") else b"application/json"
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", ctype)]})
            raise RuntimeError("scripted death before the first byte")
        await self.generate(req, receive, send)

    async def generate(self, req: dict[str, Any], receive: Any, send: Any) -> None:
        """A normal answer (streamed when asked), each chunk naming this engine."""
        b = self.behavior
        usage = {"prompt_tokens": 10, "completion_tokens": b.chunks, "total_tokens": 10 + b.chunks,
                 "prompt_tokens_details": {"cached_tokens": b.cached_tokens}}
        if not req.get("stream"):
            return await json_response(send, 200, {"id": "x", "object": "text_completion", "model": "fake-model",
                                                   "engine": self.name, "choices": [{"index": 0, "text": "abc"}],
                                                   "usage": usage})
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(b.chunks):
            if b.mode == "die_midstream" and i == 1:
                raise RuntimeError("scripted death mid-stream")
            chunk = {"engine": self.name, "choices": [{"index": 0, "text": f"t{i}"}]}
            await send({"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n".encode(),
                        "more_body": True})
            if b.chunk_interval_s:
                await asyncio.sleep(b.chunk_interval_s)
            if b.mode == "slow":
                # Watch for the client leaving while we "generate".
                try:
                    msg = await asyncio.wait_for(receive(), 0.2)
                    if msg["type"] == "http.disconnect":
                        self.aborted.append(req.get("prompt", ""))
                        return
                except asyncio.TimeoutError:
                    pass
        # Compact, as the engine writes it (the router finds the usage event by '"choices":[]').
        usage_event = json.dumps({"choices": [], "usage": usage}, separators=(",", ":"))
        tail = f"data: {usage_event}\n\n" if req.get("stream_options") else ""
        await send({"type": "http.response.body", "body": (tail + "data: [DONE]\n\n").encode()})


async def json_response(send: Any, status: int, doc: Any) -> None:
    body = json.dumps(doc).encode()
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


async def _text(send: Any, status: int, text: str) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": text.encode()})


class StubSubscriber:
    """Applies one snapshot, then idles: what a subscriber does for an engine with no traffic."""

    def __init__(self, snap: KVSnapshot, on_reset) -> None:
        self.snap, self.on_reset = snap, on_reset
        self.synced = asyncio.Event()
        self._stop = asyncio.Event()

    async def run(self) -> None:
        self.on_reset(self.snap)
        self.synced.set()
        await self._stop.wait()

    async def stop(self) -> None:
        self._stop.set()
