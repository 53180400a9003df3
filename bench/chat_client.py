"""One streaming chat completion, timed from the client: the unit of the serving benchmarks."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass

import httpx


@dataclass
class RequestResult:
    ok: bool
    sent: float
    first: float = math.nan
    last: float = math.nan
    done: float = math.nan
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    text: str = ""
    error: str = ""
    label: str = ""  # which request of a trace this is (the caller's name for it)

    @property
    def ttft(self) -> float:
        return self.first - self.sent

    @property
    def tpot(self) -> float:
        return (self.last - self.first) / (self.output_tokens - 1) if self.output_tokens > 1 else math.nan


async def send_chat(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
                    messages: list[dict] | None = None, headers: dict[str, str] | None = None) -> RequestResult:
    """Stream one greedy chat completion of `prompt` (or of `messages`, a whole conversation)."""
    body = {"model": model, "messages": messages or [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    res = RequestResult(ok=False, sent=time.perf_counter())
    try:
        parts: list[str] = []
        async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                    details = chunk["usage"].get("prompt_tokens_details") or {}
                    res.cached_tokens = details.get("cached_tokens") or 0
                for c in chunk.get("choices", []):
                    if c.get("delta", {}).get("content"):
                        parts.append(c["delta"]["content"])
                        now = time.perf_counter()
                        if math.isnan(res.first):
                            res.first = now
                        res.last = now
        res.done = time.perf_counter()
        res.text = "".join(parts)
        res.ok = res.output_tokens > 0 and not math.isnan(res.first)
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    return res
