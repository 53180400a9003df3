"""One Envoy ext_proc stream (one HTTP request through the gateway) as the endpoint picker sees it.

``PickerStream.handle`` takes each ``ProcessingRequest`` in order and returns the
``ProcessingResponse`` messages to send for it (possibly none: full-duplex mode holds the headers
answer until the body is whole). The pick itself is the router's: the body is prepared and
tokenized by ``RouterApp.prepare`` and the engine chosen by ``Dispatcher.choose`` with the router's
policy, exactly as the proxy path does; the engine's load is counted by the same ``Lease``.

Invariants:
- every request is answered once: routed (destination header + ``envoy.lb`` metadata) or refused
  with an immediate response (400 bad body, 413 too large, 429 shedding, 503 no engine, 500 a
  gateway configured in a body mode the picker cannot pick in); nothing the gateway sends raises
  out of ``handle``;
- a routed request holds one ``Lease`` on the engine that serves it (moved when the served-endpoint
  header names another) from the pick to the end of the response, or to ``close`` (the stream died:
  client gone, gateway gone, error), whichever comes first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from kvmesh.engine.api import errors
from kvmesh.engine.api.errors import APIError
from kvmesh.engine.router import epp
from kvmesh.engine.router.dispatch import Lease
from kvmesh.engine.router.extproc_observe import PendingPicks
from kvmesh.engine.router.prompt import CHAT, COMPLETIONS, PromptInfo
from kvmesh.engine.router.proxy import usage_in_chunk, all_engines_down, cached_tokens_of, shedding
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
        raise errors.invalid_request(f"the request body is not valid JSON ({e}); send an OpenAI request object") from None
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
class PickerStream:
    app: RouterApp
    request_mode: int = epp.BODY_NONE
    response_mode: int = epp.BODY_NONE
    headers: dict[str, str] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)
    decided: bool = False  # routed or refused: later request-side messages pass through
    refused: bool = False
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
    subset: frozenset[str] | None = None  # the gateway's candidate endpoints (None: any)
    picks: PendingPicks | None = None  # where an observer stream claims this pick's response
    pick_id: str = ""
    observed: bool = False  # an observer stream owns the response half
    response_seen: bool = False
    _refused_answer: list[pb.ProcessingResponse] = field(default_factory=list)
    _configured: bool = False

    # ---- messages ------------------------------------------------------------------------
    async def handle(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if not self._configured and req.HasField("protocol_config"):
            self._configured = True
            self.request_mode = req.protocol_config.request_body_mode
            self.response_mode = req.protocol_config.response_body_mode
        kind = req.WhichOneof("request")
        try:
            if kind == "request_headers":
                return await self._request_headers(req)
            if kind == "request_body":
                return await self._request_body(req.request_body)
            if kind == "request_trailers":
                return await self._request_trailers()
            if kind == "response_headers":
                return self.response_headers(req)
            if kind == "response_body":
                return self.response_body(req.response_body)
            if kind == "response_trailers":
                self.finish()
                return [epp.empty("response_trailers")]
            return self.refuse(errors.invalid_request("empty ext_proc message: it carries no headers, body or "
                                                       "trailers"))
        except epp.ProtocolError as e:
            return self.refuse(errors.invalid_request(str(e)))
        except APIError as e:
            return self.refuse(e)

    async def _request_headers(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if self.decided:
            return [epp.empty("request_headers")]
        self.headers = epp.header_map(req.request_headers)
        self.subset = epp.subset_hint(req.metadata_context)
        problem = body_mode_problem(self.request_mode)
        if problem is not None:
            return self.refuse(problem)
        length = self.headers.get("content-length", "")
        limit = self.app.settings.max_request_bytes
        if length.isdigit() and int(length) > limit:
            return self.refuse(errors.request_too_large(limit, int(length)))
        if req.request_headers.end_of_stream or self.request_mode == epp.BODY_NONE:
            pick = await self._pick(b"")
            return self._refused_answer if self.refused else [epp.headers_answer(pick)]
        if self.request_mode == epp.BODY_BUFFERED:
            return [epp.empty("request_headers")]
        return []  # full duplex: the headers answer carries the pick, once the body is whole

    async def _request_body(self, msg: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if self.decided:
            if self.refused:
                return []
            return [epp.streamed_body(msg.body, msg.end_of_stream)] if self.request_mode == epp.BODY_FULL_DUPLEX \
                else [epp.empty("request_body")]
        limit = self.app.settings.max_request_bytes
        if len(self.body) + len(msg.body) > limit:
            return self.refuse(errors.request_too_large(limit, len(self.body) + len(msg.body)))
        self.body += msg.body
        if not msg.end_of_stream:
            return []  # more body, or trailers, to come
        return await self._answer_whole_body(end_of_stream=True)

    async def _request_trailers(self) -> list[pb.ProcessingResponse]:
        if self.decided:
            return [epp.empty("request_trailers")] if not self.refused else []
        out = await self._answer_whole_body(end_of_stream=False)
        return out if self.refused else out + [epp.empty("request_trailers")]

    async def _answer_whole_body(self, end_of_stream: bool) -> list[pb.ProcessingResponse]:
        body = bytes(self.body)
        pick = await self._pick(body)
        if self.refused:
            return self._refused_answer
        if self.request_mode == epp.BODY_FULL_DUPLEX:
            return [epp.headers_answer(pick), epp.streamed_body(pick.body if pick.body is not None else body,
                                                                end_of_stream)]
        return [epp.buffered_answer(pick)]

    # ---- the pick ------------------------------------------------------------------------
    def refuse(self, err: APIError) -> list[pb.ProcessingResponse]:
        """Answer the client with ``err`` now; the request goes to no engine."""
        self.decided = self.refused = True
        self._refused_answer = [epp.immediate(err)]
        return self._refused_answer

    async def _pick(self, body: bytes) -> epp.Pick:
        """Choose the engine (or refuse: ``self.refused`` set, ``_refused_answer`` holds the answer)."""
        t0 = time.perf_counter()
        app = self.app
        path = epp.request_path(self.headers)
        if self.headers.get(":method", "POST") == "POST" and path in GENERATION_PATHS:
            try:
                check_generation_body(body)
            except APIError as e:
                self.refuse(e)
                return epp.Pick("")
        fleet, dispatch = app.fleet, app.dispatch
        if fleet is None:
            self.refuse(all_engines_down(["the router has not started its engine pool yet"]))
            return epp.Pick("")
        out, info = await app.prepare(path, body, self.headers.get("authorization"))
        address_of = {url: epp.endpoint_address(url) for url in fleet.engines}
        exclude = frozenset(u for u, a in address_of.items() if self.subset is not None and a not in self.subset)
        if dispatch.saturated(fleet, exclude):
            app.metrics.count("none", "shed")
            self.refuse(shedding())
            return epp.Pick("")
        session = session_key(self.headers, info.user) if app.settings.policy == "session" else None
        url, predicted = dispatch.choose(fleet, app.policy, info, session, exclude, time.monotonic())
        app.metrics.decision.observe(time.perf_counter() - t0)
        if url is None:
            app.metrics.count("none", "unavailable")
            why = (f"none of the gateway's candidates ({', '.join(sorted(self.subset))}) is a healthy engine"
                   if self.subset is not None else "no engine is healthy")
            self.refuse(all_engines_down([why]))
            return epp.Pick("")
        self.decided = True
        self.url, self.address, self.info, self.predicted = url, address_of[url], info, predicted
        self.lease = Lease.take(fleet.engines.get(url), max(0, info.num_prompt_tokens - predicted))
        self.picked_at = time.perf_counter()
        if self.picks is not None:
            self.pick_id = self.picks.register(self)
        return epp.Pick(self.address, out if out != body else None, self.pick_id)

    # ---- the response --------------------------------------------------------------------
    def response_headers(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        self.response_seen = True
        headers = epp.header_map(req.response_headers)
        status = headers.get(":status", "")
        self.status = int(status) if status.isdigit() else 0
        self.sse = headers.get("content-type", "").startswith("text/event-stream")
        served = epp.served_endpoint(headers, req.metadata_context)
        if self.lease is not None and served and served != self.address:
            self._move_to(served)
        if self.lease is not None and self.status == 503 and self.url is not None and self.app.fleet is not None:
            self.app.fleet.mark_failed(self.url, "answered 503 through the gateway")
        if req.response_headers.end_of_stream:
            self._first_byte()
            self.finish()
        return [epp.empty("response_headers")]

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

    def response_body(self, msg: pb.HttpBody) -> list[pb.ProcessingResponse]:
        self.response_seen = True
        chunk = msg.body
        if self.lease is not None and not self.lease.released:
            if chunk:
                self._first_byte()
            if self.sse:
                if token_events(chunk):
                    self.lease.first_token()
                if self.cached is None:
                    self.cached = usage_in_chunk(chunk)
            elif len(self.response_kept) + len(chunk) <= MAX_RESPONSE_BODY_KEPT:
                self.response_kept += chunk
            if msg.end_of_stream:
                if not self.sse and self.status == 200:
                    self.cached = cached_tokens_of(bytes(self.response_kept))
                self.finish()
        if self.response_mode == epp.BODY_FULL_DUPLEX:
            return [epp.streamed_body(chunk, msg.end_of_stream, request=False)]
        return [epp.empty("response_body")]

    def finish(self, outcome: str | None = None) -> None:
        """The response is over (or the stream died: ``outcome`` "aborted"): release the engine."""
        if self.lease is None or self.lease.released:
            return
        if self.picks is not None:
            self.picks.discard(self.pick_id)
        if outcome is None:
            self.lease.first_token()  # a whole answer: the prefill is over (a no-op once a token event came)
        self.lease.release()
        metrics = self.app.metrics
        metrics.count(self.url or "none", outcome or outcome_of(self.status))
        if outcome is None:
            self.app.dispatch.observe_cached(self.info, self.predicted, self.cached)

    def close(self, clean: bool = False) -> None:
        """The gRPC stream ended. If its response is an observer stream's to follow (this filter
        does not receive the response, or the gateway ended the stream cleanly before any response
        reached it), the pick waits for the observer (engine/router/extproc_observe.py): an
        abandoned request is then released by the observer's end or the orphan timer. Otherwise a
        stream cancelled while its request held an engine was abandoned.

        Why not trust ``clean`` alone: Envoy 1.40 often resets a full-duplex stream it has finished
        with instead of half-closing it, so a cancel can arrive before the observer's first message
        in a perfectly healthy request."""
        if self.observed:
            return
        observer_owned = clean or self.response_mode == epp.BODY_NONE
        if observer_owned and self.picks is not None and self.pick_id and not self.response_seen:
            self.picks.orphan(self.pick_id)
            return
        self.finish("aborted")
