"""The response half of a pick, watched off the request's path by a second ext_proc filter.

Envoy waits for the picker's answer to every message its ext_proc filter sends, so a single
filter that also reads the response (to follow the served endpoint, the first token and the end of
the stream, as GIE's reference gateway wires it) puts two or three more gRPC round trips on every
request's path. kvmesh's rendered gateway (engine/router/envoy_config.py) splits the work:

- the *pick* filter sees the request only (headers and body) and answers with the destination;
  its answer also sets ``x-kvmesh-pick: <id>``, a random id naming this pick;
- an *observer* filter after it runs in Envoy's ``observability_mode``: Envoy sends it the request
  headers (carrying that id), the response headers and the response body without waiting for any
  answer. Its stream claims the pick by id and feeds the response to the same ``PickerStream``,
  which keeps the load accounting exactly as the single-filter wiring does.

Invariants:
- an id is minted by the picker (128 random bits: a client cannot guess a live one, and the pick
  filter overwrites any ``x-kvmesh-pick`` the client sent), held from the pick until the response
  ends, an observer claims it, or ``orphan_ttl_s`` after its pick stream ended unclaimed;
- a pick is released exactly once: by its response's end, by the stream that owns it dying, or by
  the orphan timer (a gateway without an observer filter and without response processing).
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from kvmesh.engine.router import epp
from kvmesh.engine.router.epp import PICK_ID

if TYPE_CHECKING:
    from kvmesh.engine.router.extproc_stream import PickerStream


@dataclass
class PendingPicks:
    """Live picks by id, for an observer stream to claim."""

    orphan_ttl_s: float = 5.0
    _by_id: dict[str, PickerStream] = field(default_factory=dict)

    def register(self, stream: PickerStream) -> str:
        pick_id = secrets.token_hex(16)
        self._by_id[pick_id] = stream
        return pick_id

    def claim(self, pick_id: str) -> PickerStream | None:
        """The pick named ``pick_id`` (now owned by the caller), or None for an unknown id."""
        stream = self._by_id.pop(pick_id, None)
        if stream is not None:
            stream.observed = True
        return stream

    def discard(self, pick_id: str) -> None:
        self._by_id.pop(pick_id, None)

    def orphan(self, pick_id: str) -> None:
        """The pick's own stream ended before any response reached it: wait ``orphan_ttl_s`` for an
        observer, then release the engine (nothing will ever tell the picker the request ended)."""
        if pick_id in self._by_id:
            asyncio.get_running_loop().call_later(self.orphan_ttl_s, self._expire, pick_id)

    def _expire(self, pick_id: str) -> None:
        stream = self._by_id.pop(pick_id, None)
        if stream is not None:
            stream.finish("aborted")

    def __len__(self) -> int:
        return len(self._by_id)


@dataclass
class ObserverStream:
    """One observability-mode ext_proc stream: feeds a claimed pick its response; answers nothing
    (Envoy ignores answers in that mode)."""

    picks: PendingPicks
    target: PickerStream | None = None

    def handle(self, req: pb.ProcessingRequest) -> None:
        kind = req.WhichOneof("request")
        if kind == "request_headers":
            if self.target is None:
                pick_id = epp.header_map(req.request_headers).get(PICK_ID, "")
                self.target = self.picks.claim(pick_id) if pick_id else None
            return
        target = self.target
        if target is None:
            return  # a request the picker did not route (refused, or routed by another picker)
        if kind == "response_headers":
            target.response_headers(req)
        elif kind == "response_body":
            target.response_body(req.response_body)
        elif kind == "response_trailers":
            target.finish()

    def close(self) -> None:
        """The observer's stream ended: a response not seen to its end was abandoned."""
        if self.target is not None:
            self.target.finish("aborted")
