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

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from kvmesh.engine.api import errors
from kvmesh.engine.api.errors import APIError
from kvmesh.engine.router import epp
from kvmesh.engine.router.extproc_observe import PendingPicks
from kvmesh.engine.router.pick import PickSession, body_mode_problem

if TYPE_CHECKING:
    from kvmesh.engine.router.app import RouterApp


@dataclass
class PickerStream:
    app: RouterApp
    picks: PendingPicks | None = None  # where an observer stream claims this pick's response
    request_mode: int = epp.BODY_NONE
    response_mode: int = epp.BODY_NONE
    headers: dict[str, str] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)
    decided: bool = False  # routed or refused: later request-side messages pass through
    refused: bool = False
    subset: frozenset[str] | None = None  # the gateway's candidate endpoints (None: any)
    session: PickSession = field(init=False)
    pick_id: str = ""
    observed: bool = False  # an observer stream owns the response half
    response_seen: bool = False
    _refused_answer: list[pb.ProcessingResponse] = field(default_factory=list)
    _configured: bool = False

    def __post_init__(self) -> None:
        self.session = PickSession(self.app, on_finish=self._discard_pick)

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
            return self.refuse(errors.invalid_request(epp.EMPTY_MESSAGE))
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
            return [epp.headers_answer(await self._pick(b""))]
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
        """The session's pick (an ``APIError`` propagates to ``handle``, which refuses with it)."""
        self.decided = True
        pick = await self.session.decide(self.headers, body, self.subset)
        if self.picks is not None:
            self.pick_id = self.picks.register(self)
            pick = replace(pick, pick_id=self.pick_id)
        return pick

    def _discard_pick(self) -> None:
        if self.picks is not None:
            self.picks.discard(self.pick_id)

    # ---- the response --------------------------------------------------------------------
    def response_headers(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        self.response_seen = True
        headers = epp.header_map(req.response_headers)
        status = headers.get(":status", "")
        self.session.response_started(int(status) if status.isdigit() else 0, headers.get("content-type", ""),
                                      epp.served_endpoint(headers, req.metadata_context),
                                      req.response_headers.end_of_stream)
        return [epp.empty("response_headers")]

    def response_body(self, msg: pb.HttpBody) -> list[pb.ProcessingResponse]:
        self.response_seen = True
        self.session.response_chunk(msg.body, msg.end_of_stream)
        if self.response_mode == epp.BODY_FULL_DUPLEX:
            return [epp.streamed_body(msg.body, msg.end_of_stream, request=False)]
        return [epp.empty("response_body")]

    def finish(self, outcome: str | None = None) -> None:
        """The response is over (or the stream died: ``outcome`` "aborted"): release the engine."""
        self.session.finish(outcome)

    def close(self, clean: bool = False) -> None:
        """The gRPC stream ended. If its response is an observer stream's to follow (this filter
        does not receive the response, or the gateway ended the stream cleanly before any response
        reached it), the pick waits for the observer (engine/router/extproc_observe.py): an
        abandoned request is then released by the observer's end or the orphan timer. Otherwise a
        stream cancelled while its request held an engine was abandoned.

        A filter that reads the response headers but not its body (``response_body_mode`` NONE,
        GIE's common wiring) releases the engine when its stream ends after them.

        Why not trust ``clean`` alone: Envoy 1.40 often resets a full-duplex stream it has finished
        with instead of half-closing it, so a cancel can arrive before the observer's first message
        in a perfectly healthy request."""
        if self.observed:
            return
        if self.response_seen and self.response_mode == epp.BODY_NONE:
            # The response headers were the last this filter is sent (no body, no trailers): the
            # request is counted by their status, not as abandoned, whatever ended the stream.
            self.finish()
            return
        observer_owned = clean or self.response_mode == epp.BODY_NONE
        if observer_owned and self.picks is not None and self.pick_id and not self.response_seen:
            self.picks.orphan(self.pick_id)
            return
        self.finish("aborted")
