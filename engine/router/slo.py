"""A request's latency as its client sees it: the router's end-to-end TTFT and TPOT.

Engines time only their own part of a request: a decode engine's TTFT starts at stage 2 of a
disaggregated request (near zero, its first token came with the KV), and no engine sees the
router's wait for decode room, stage 1, or a retry on another engine. The router does: it is
where the client waits. ``ClientClock.wrap(send)`` timestamps what the router hands to the ASGI
server for one generation request; ``RouterMetrics.observe_client`` records the finished clock.

Definitions (seconds, from ``received``: the router's clock once it has the request body):

- TTFT of a streamed response: until the first body chunk that completes an SSE event carrying
  generated tokens (a chat stream's opening role-only event carries none).
- TTFT of a response that is not streamed: until its body, the first moment the client sees any
  token (inside one body the router cannot see token timing). It is observed under
  ``stream="false"``, so a consumer of first-token latency can leave these out.
- TPOT (streamed responses only): (last token chunk - first token chunk) / (tokens - 1), once
  per response that ended without an in-band error and had at least 2 tokens. Tokens:
  ``usage.completion_tokens`` when the stream ends with a usage event
  (``stream_options.include_usage``), else the token events counted (an engine event may hold
  several tokens, so then TPOT is an upper bound). A request with several choices counts as one.

Only 200 responses are timed; a client that leaves after its first token still counts for TTFT.

Invariant (the hot path): per relayed chunk the clock does one clock read and, past the first
token, one ``bytes.count`` scan (in C) for a chunk of token events (``only_tokens``), a few for
any other; it never parses JSON but a stream's usage-only event, once.
Generated text cannot fake a marker below: JSON escapes every quote inside a string, and no
event ends in ``data: [DONE]`` but the stream's last.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:  # proxy imports token_events from here
    from kvmesh.engine.router.proxy import Send

_EVENT_END = b"\n\n"
_ROLE = b'"role"'  # a chat stream's opening event, one per choice: a role and no token
_USAGE_ONLY = b'"choices":[]'  # the include_usage event
_ERROR = b'{"error"'  # an in-band error event (the engine's, or the router's after a broken stream)
_DONE = b"data: [DONE]\n\n"
_CHOICES_END = b"]}\n\n"  # an event whose last field is its choices (the engines write them last)
_NO_CHOICES_END = b"[]}\n\n"
_json = msgspec.json.Decoder()


def token_events(chunk: bytes) -> int:
    """SSE events that ``chunk`` completes and that carry generated tokens.

    Counts event terminators, less the events known to carry none (role-only openings, the
    usage-only event, error events, ``[DONE]``). An event split across chunks counts in the
    chunk that completes it, which is when a client can read it.
    """
    n = chunk.count(_EVENT_END)
    if not n:
        return 0
    n -= chunk.count(_ROLE) + chunk.count(_USAGE_ONLY) + chunk.count(_ERROR)
    if chunk.endswith(_DONE):
        n -= 1
    return max(0, n)


def only_tokens(chunk: bytes) -> bool:
    """Whether every event ``chunk`` completes carries tokens, judged from its end alone, for a
    chunk after a stream's first token event: role-only events open a stream and usage and
    error events end it (only ``[DONE]`` follows them), so a chunk whose last event closes a
    non-empty choices array holds none of them. False means "look closer", not "no tokens"."""
    return chunk.endswith(_CHOICES_END) and not chunk.endswith(_NO_CHOICES_END)


def completion_tokens_in(chunk: bytes) -> int | None:
    """``usage.completion_tokens`` of the usage-only event in ``chunk``, if it holds one."""
    for event in chunk.split(_EVENT_END):
        if _USAGE_ONLY in event and event.startswith(b"data: "):
            try:
                n = _json.decode(event[6:])["usage"]["completion_tokens"]
            except (msgspec.DecodeError, KeyError, TypeError):
                return None
            return n if isinstance(n, int) and not isinstance(n, bool) else None
    return None


def is_event_stream(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(k == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)


@dataclass
class ClientClock:
    """What one response looked like to its client, fed by ``on_message`` (see the module doc).

    Times are ``time.perf_counter()`` readings. ``first``/``last``: the first and last chunk
    that carried tokens (a non-streamed body is both); ``ended``: the response's last body
    message (or the stream's ``[DONE]``) went out; ``failed``: an in-band error event went out.
    """

    received: float
    status: int = 0
    stream: bool = False
    first: float | None = None
    last: float | None = None
    events: int = 0
    usage_tokens: int | None = None
    ended: bool = False
    failed: bool = False

    def on_message(self, msg: dict[str, Any], now: float) -> None:
        if msg["type"] == "http.response.start":
            self.status = msg["status"]
            self.stream = is_event_stream(msg.get("headers") or [])
            return
        if self.status != 200 or msg["type"] != "http.response.body":
            return
        body = msg.get("body", b"")
        if not msg.get("more_body", False):
            self.ended = True
        if not self.stream:
            if self.first is None:
                self.first = now
            self.last = now
            return
        if not body:
            return
        if body.endswith(_DONE):
            # The client has the whole stream: it may hang up before the closing empty message,
            # which cancels the request (router/app.py) and would leave a complete stream untimed.
            self.ended = True
        if self.first is not None and only_tokens(body):  # the common chunk: one scan
            self.last = now
            self.events += body.count(_EVENT_END)
            return
        n = token_events(body)
        if n:
            if self.first is None:
                self.first = now
            self.last = now
            self.events += n
        if _USAGE_ONLY in body:
            self.usage_tokens = completion_tokens_in(body)
        if _ERROR in body:
            self.failed = True

    def wrap(self, send: Send) -> Send:
        """``send`` that feeds this clock first (a plain function returning ``send``'s awaitable:
        no extra coroutine per chunk)."""
        on_message, clock = self.on_message, time.perf_counter

        def timed(msg: dict[str, Any]) -> Awaitable[None]:
            on_message(msg, clock())
            return send(msg)

        return timed

    def ttft_s(self) -> float | None:
        """None when no token reached the client in a 200 response."""
        if self.first is None:
            return None
        return max(0.0, self.first - self.received)

    def tpot_s(self) -> float | None:
        """None unless a stream ended normally with at least 2 tokens."""
        if not (self.stream and self.ended and not self.failed) or self.first is None or self.last is None:
            return None
        tokens = self.usage_tokens if self.usage_tokens is not None else self.events
        if tokens < 2:
            return None
        return max(0.0, (self.last - self.first) / (tokens - 1))
