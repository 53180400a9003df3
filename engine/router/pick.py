"""One request's pick through a gateway, and the engine load it holds until its response ends.

Transport-free: the Python ext_proc stream (engine/router/extproc_stream.py) and the compiled
ext_proc front's socket (engine/router/front_socket.py) both drive a ``PickSession`` with what
they read from Envoy, so the two carry the same pick (``RouterApp.prepare`` and
``Dispatcher.choose`` with the router's policy, as the proxy path does) and the same accounting.

Invariant: a routed session holds one ``Lease`` on the engine that serves it (moved when the
served endpoint names another) from ``decide`` until ``finish``; ``finish`` is idempotent.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from kvmesh.engine.api import errors
from kvmesh.engine.api.errors import APIError
from kvmesh.engine.api.params import STATE_HINTS_HEADER, format_state_hints
from kvmesh.engine.router import epp
from kvmesh.engine.router.dispatch import Lease
from kvmesh.engine.router.prompt import CHAT, COMPLETIONS, PromptInfo
from kvmesh.engine.router.proxy import all_engines_down, cached_tokens_of, shedding, usage_in_chunk
from kvmesh.engine.router.sessions import session_key
from kvmesh.engine.router.slo import token_events

if TYPE_CHECKING:
    from kvmesh.engine.router.app import RouterApp

GENERATION_PATHS = frozenset({COMPLETIONS, CHAT})
MAX_RESPONSE_BODY_KEPT = 1 << 20
"""A non-streamed response body is kept up to this size to read its ``usage`` (longer: not read)."""
_json = msgspec.json.Decoder()


def check_generation_body(body: bytes) -> None:
    """A generation body must be a JSON object naming its ``model`` (the gateway routes by model,
    and so would an HTTPRoute); raises the 400 that says what is wrong."""
    try:
        doc = _json.decode(body)
    except msgspec.DecodeError as e:
        raise errors.invalid_request(f"the request body is not valid JSON ({e}); send an OpenAI request "
                                     "object") from None
    if not isinstance(doc, dict):
        raise errors.invalid_request(f"the request body must be a JSON object, got {type(doc).__name__}")
    if not isinstance(doc.get("model"), str) or not doc["model"]:
        raise errors.invalid_request("the request body names no model: set the 'model' field", "model")


def body_mode_problem(mode: int) -> APIError | None:
    """The 500 for a request body mode the picker cannot pick in (it needs the whole body first)."""
    if mode in (epp.BODY_NONE, epp.BODY_BUFFERED, epp.BODY_FULL_DUPLEX):
        return None
    return APIError(f"the gateway sends request bodies in {epp.BODY_MODE_NAMES.get(mode, mode)} mode; the kvmesh "
                    "picker needs the whole body before it picks: configure the ext_proc filter with "
                    "request_body_mode BUFFERED or FULL_DUPLEX_STREAMED", 500, "server_error", "picker_misconfigured")


def outcome_of(status: int) -> str:
    return "ok" if status < 400 else "client_error" if status < 500 else "upstream_error"


@dataclass
class PickSession:
    app: RouterApp
    on_finish: Callable[[], None] | None = None  # called once when the request's load is released
    url: str | None = None
    address: str | None = None
    lease: Lease | None = None
    info: PromptInfo = field(default_factory=PromptInfo)
    predicted: int = 0
    picked_at: float = 0.0
    status: int = 0
    sse: bool = False
    first_byte_seen: bool = False
    response_kept: bytearray = field(default_factory=bytearray)
    cached: int | None = None

    async def decide(self, headers: Mapping[str, str], body: bytes, subset: frozenset[str] | None) -> epp.Pick:
        """Choose the engine for the request (``headers`` lower-cased, pseudo-headers included;
        ``subset``: the gateway's candidates, None for any) and take its load; raises the
        ``APIError`` to answer instead (400 bad body, 429 shedding, 503 no engine)."""
        t0 = time.perf_counter()
        path = self._check(headers, body)
        prepared = await self.app.prepare(path, body, headers.get("authorization"))
        return self._choose(t0, headers, body, prepared, subset)

    def decide_now(self, headers: Mapping[str, str], body: bytes, subset: frozenset[str] | None) -> epp.Pick | None:
        """``decide`` without yielding to the event loop, or None (nothing done) where the prompt is
        long enough to be tokenized on a worker thread: then await ``decide``."""
        t0 = time.perf_counter()
        path = self._check(headers, body)
        prepared = self.app.prepare_now(path, body, headers.get("authorization"))
        return None if prepared is None else self._choose(t0, headers, body, prepared, subset)

    def _check(self, headers: Mapping[str, str], body: bytes) -> str:
        """The request's path, once the body is one the picker can route (raises the 400 or 503)."""
        path = epp.request_path(headers)
        if headers.get(":method", "POST") == "POST" and path in GENERATION_PATHS:
            check_generation_body(body)
        if self.app.fleet is None:
            raise all_engines_down(["the router has not started its engine pool yet"])
        return path

    def _choose(self, t0: float, headers: Mapping[str, str], body: bytes, prepared: tuple[bytes, PromptInfo],
                subset: frozenset[str] | None) -> epp.Pick:
        app = self.app
        out, info = prepared
        fleet, dispatch = app.fleet, app.dispatch
        assert fleet is not None  # _check
        address_of = {url: epp.endpoint_address(url) for url in fleet.engines}
        exclude = frozenset(u for u, a in address_of.items() if subset is not None and a not in subset)
        if dispatch.saturated(fleet, exclude):
            app.metrics.count("none", "shed")
            raise shedding()
        session = session_key(headers, info.user) if app.settings.policy == "session" else None
        url, predicted = dispatch.choose(fleet, app.policy, info, session, exclude, time.monotonic())
        app.metrics.decision.observe(time.perf_counter() - t0)
        if url is None:
            app.metrics.count("none", "unavailable")
            why = (f"none of the gateway's candidates ({', '.join(sorted(subset))}) is a healthy engine"
                   if subset is not None else "no engine is healthy")
            raise all_engines_down([why])
        self.url, self.address, self.info, self.predicted = url, address_of[url], info, predicted
        self.lease = Lease.take(fleet.engines.get(url), max(0, info.num_prompt_tokens - predicted))
        self.picked_at = time.perf_counter()
        # Hybrid engines: where to checkpoint (engine/router/app.py). Always set, so a client's own
        # value never reaches an engine (empty: none).
        hints = format_state_hints(fleet.state_hints(info))
        return epp.Pick(self.address, out if out != body else None, headers=((STATE_HINTS_HEADER, hints),))

    def response_started(self, status: int, content_type: str, served: str | None, end_of_stream: bool) -> None:
        """The response headers: its status, whether it streams, and the endpoint that served it."""
        self.status = status
        self.sse = content_type.startswith("text/event-stream")
        if self.lease is not None and served and served != self.address:
            self._move_to(served)
        if self.lease is not None and status == 503 and self.url is not None and self.app.fleet is not None:
            self.app.fleet.mark_failed(self.url, "answered 503 through the gateway")
        if end_of_stream:
            self._first_byte()
            self.finish()

    def _move_to(self, served: str) -> None:
        """The gateway sent the request elsewhere (its own retry or fallback): the load moves there."""
        fleet = self.app.fleet
        assert self.lease is not None
        self.lease.release()
        url = next((u for u in (fleet.engines if fleet else {}) if epp.endpoint_address(u) == served), None)
        self.url, self.address, self.predicted = url, served, 0
        state = fleet.engines.get(url) if fleet is not None and url is not None else None
        self.lease = Lease.take(state, self.info.num_prompt_tokens)

    def _first_byte(self) -> None:
        if not self.first_byte_seen:
            self.first_byte_seen = True
            self.app.metrics.ttft.observe(time.perf_counter() - self.picked_at)

    def response_chunk(self, chunk: bytes, end_of_stream: bool) -> None:
        """A piece of the response body: the first token, the usage, the end."""
        if self.lease is None or self.lease.released:
            return
        if chunk:
            self._first_byte()
        if self.sse:
            if token_events(chunk):
                self.lease.first_token()
            if self.cached is None:
                self.cached = usage_in_chunk(chunk)
        elif len(self.response_kept) + len(chunk) <= MAX_RESPONSE_BODY_KEPT:
            self.response_kept += chunk
        if end_of_stream:
            if not self.sse and self.status == 200:
                self.cached = cached_tokens_of(bytes(self.response_kept))
            self.finish()

    def finish(self, outcome: str | None = None) -> None:
        """The response is over (or the request was abandoned: ``outcome`` "aborted"): release the engine."""
        if self.lease is None or self.lease.released:
            return
        if self.on_finish is not None:
            self.on_finish()
        if outcome is None:
            self.lease.first_token()  # a whole answer: the prefill is over (a no-op once a token event came)
        self.lease.release()
        metrics = self.app.metrics
        metrics.count(self.url or "none", outcome or outcome_of(self.status))
        if outcome is None:
            self.app.dispatch.observe_cached(self.info, self.predicted, self.cached)
