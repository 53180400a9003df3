"""The router's side of the compiled ext_proc front (engine/router/front/): a Unix socket on which
the front asks for picks and tells how responses go.

Frames, both ways: a 4-byte big-endian length, then one JSON object (``FrontFrame`` from the front,
``Answer`` to it; engine/router/front/router.go declares the same fields). The front asks
``pick`` under a request id and waits for ``route`` or ``refuse``; it tells ``resp`` (response
headers), ``chunk`` (response body) and ``end`` without waiting. The router pushes ``ready`` on
connect and whenever its readiness changes, which the front serves as its gRPC health.

Invariants:
- every decision is the router's, made by ``PickSession`` exactly as the Python ext_proc stream
  makes it (refusals included: the front sends why it cannot ask for a pick, the router writes
  the error);
- a routed session is finished exactly once: by its response's end, by an ``end`` frame, or by its
  connection closing (the front died or restarted: its requests are abandoned).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import msgspec

from kvmesh.engine.api import errors
from kvmesh.engine.api.errors import APIError
from kvmesh.engine.router import epp
from kvmesh.engine.router.pick import PickSession, body_mode_problem

if TYPE_CHECKING:
    from kvmesh.engine.router.app import RouterApp

log = logging.getLogger("kvmesh.router.front")

MAX_FRAME = 1 << 30
READY_EVERY_S = 0.5


class FrontFrame(msgspec.Struct, omit_defaults=True):
    """A message from the front."""

    t: str
    id: int = 0
    headers: dict[str, str] = {}
    body: bytes = b""
    subset: Any = msgspec.UNSET  # the gateway's hint as JSON (absent: none)
    mode: int = 0  # the filter's request body mode
    too_large: int = 0  # the body's length when it is over --max-request-bytes
    problem: str = ""  # "empty_message": Envoy sent a message with nothing in it
    status: int = 0
    content_type: str = ""
    served: str = ""
    eos: bool = False
    outcome: str = ""  # end: "" a whole response, "aborted" abandoned


class Answer(msgspec.Struct, omit_defaults=True):
    """A message to the front."""

    t: str
    id: int = 0
    address: str = ""
    body: bytes = b""
    changed: bool = False
    status: int = 0
    headers: list[tuple[str, str]] = []
    details: str = ""
    ready: bool = False


class FrameError(ValueError):
    """The front sent something that is not a frame of this protocol (a version mismatch)."""


_decode = msgspec.json.Decoder(FrontFrame).decode
_encode = msgspec.json.Encoder().encode


def frame_bytes(msg: msgspec.Struct) -> bytes:
    payload = _encode(msg)
    return len(payload).to_bytes(4, "big") + payload


def refusal_for(frame: FrontFrame, limit: int) -> APIError | None:
    """The refusal the front asked for without a pick (it cannot pick this request), if any."""
    if frame.problem == "empty_message":
        return errors.invalid_request(epp.EMPTY_MESSAGE)
    if frame.problem:
        return errors.invalid_request(f"the picker front reported an unknown problem {frame.problem!r}")
    problem = body_mode_problem(frame.mode)
    if problem is not None:
        return problem
    if frame.too_large:
        return errors.request_too_large(limit, frame.too_large)
    return None


@dataclass(eq=False)
class FrontConnection:
    """One connected front: its requests' sessions by id."""

    app: RouterApp
    transport: asyncio.WriteTransport
    sessions: dict[int, PickSession] = field(default_factory=dict)
    tasks: set[asyncio.Task] = field(default_factory=set)

    def send(self, msg: Answer) -> None:
        if not self.transport.is_closing():
            self.transport.write(frame_bytes(msg))

    def handle(self, frame: FrontFrame) -> None:
        kind = frame.t
        if kind == "pick":
            self._start_pick(frame)
            return
        session = self.sessions.get(frame.id)
        if session is None:
            return  # refused, finished or abandoned already
        if kind == "resp":
            session.response_started(frame.status, frame.content_type, frame.served or None, frame.eos)
        elif kind == "chunk":
            session.response_chunk(frame.body, frame.eos)
        elif kind == "end":
            session.finish(frame.outcome or None)
        else:
            raise FrameError(f"unknown frame type {kind!r}")
        if kind == "end" or frame.eos:
            self.sessions.pop(frame.id, None)

    def _start_pick(self, frame: FrontFrame) -> None:
        """Pick at once where the prompt is short (no task, no loop turn: the usual case), else on a task."""
        if frame.id in self.sessions:
            raise FrameError(f"request id {frame.id} is already in use")  # the front numbers requests uniquely
        session = self.sessions[frame.id] = PickSession(self.app)
        try:
            err = refusal_for(frame, self.app.settings.max_request_bytes)
            if err is not None:
                raise err
            pick = session.decide_now(frame.headers, frame.body, _subset(frame))
        except Exception as e:  # noqa: BLE001 - _refuse_for tells a bug from an answer
            self._refuse_for(frame.id, e)
            return
        if pick is not None:
            self._route(frame.id, session, pick)
            return
        task = asyncio.create_task(self._pick_later(frame, session))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _pick_later(self, frame: FrontFrame, session: PickSession) -> None:
        try:
            pick = await session.decide(frame.headers, frame.body, _subset(frame))
        except Exception as e:  # noqa: BLE001 - _refuse_for tells a bug from an answer
            self._refuse_for(frame.id, e)
            return
        self._route(frame.id, session, pick)

    def _route(self, request_id: int, session: PickSession, pick: epp.Pick) -> None:
        if self.sessions.get(request_id) is not session:  # ended while it was being picked
            session.finish("aborted")
            return
        self.send(Answer("route", request_id, address=pick.address, body=pick.body or b"",
                         changed=pick.body is not None))

    def _refuse_for(self, request_id: int, e: Exception) -> None:
        if isinstance(e, epp.ProtocolError):
            err = errors.invalid_request(str(e))
        elif isinstance(e, APIError):
            err = e
        else:  # a bug must cost one request, never the picker
            log.error("picking for the ext_proc front failed", exc_info=e)
            err = errors.internal_error(f"the picker failed on this request ({type(e).__name__})")
        self.sessions.pop(request_id, None)
        r = epp.Refusal.of(err)
        self.send(Answer("refuse", request_id, body=r.body, status=r.status, headers=r.headers, details=r.details))

    def close(self) -> None:
        """The front is gone: every request it carried is abandoned."""
        for task in self.tasks:
            task.cancel()
        sessions, self.sessions = self.sessions, {}
        for session in sessions.values():
            session.finish("aborted")


def _subset(frame: FrontFrame) -> frozenset[str] | None:
    return None if frame.subset is msgspec.UNSET else epp.subset_of(frame.subset)


class _FrontProtocol(asyncio.Protocol):
    """Frames off one front's connection, handled as they complete (a protocol, not a stream
    reader: no coroutine per frame on the request's path)."""

    def __init__(self, socket: FrontSocket) -> None:
        self.socket = socket
        self.buffer = bytearray()
        self.conn: FrontConnection | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.conn = FrontConnection(self.socket.app, cast(asyncio.WriteTransport, transport))  # uvloop's too
        self.socket.connections.add(self.conn)
        self.conn.send(Answer("ready", ready=self.socket.app.ready()))

    def data_received(self, data: bytes) -> None:
        conn = self.conn
        assert conn is not None
        buf = self.buffer
        buf += data
        try:
            while len(buf) >= 4:
                n = int.from_bytes(buf[:4], "big")
                if n > MAX_FRAME:
                    raise FrameError(f"a frame of {n} bytes")
                if len(buf) < 4 + n:
                    return
                frame = _decode(memoryview(buf)[4:4 + n])
                del buf[:4 + n]
                conn.handle(frame)
        except (FrameError, msgspec.DecodeError, msgspec.ValidationError) as e:
            log.error("the ext_proc front sent a malformed frame (%s); dropping its connection", e)
            conn.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.conn is not None:
            self.socket.connections.discard(self.conn)
            self.conn.close()


class FrontSocket:
    """The Unix socket server the front connects to (mode 0600: only this user may pick)."""

    def __init__(self, app: RouterApp, path: str) -> None:
        self.app, self.path = app, path
        self.server: asyncio.AbstractServer | None = None
        self.connections: set[FrontConnection] = set()
        self._ready: bool | None = None
        self._ready_task: asyncio.Task | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_unix_server(lambda: _FrontProtocol(self), path=self.path)
        os.chmod(self.path, 0o600)
        self._ready_task = asyncio.create_task(self._ready_loop(), name="ext_proc front readiness")

    async def _ready_loop(self) -> None:
        while True:
            ready = self.app.ready()
            if ready != self._ready:
                self._ready = ready
                for conn in self.connections:
                    conn.send(Answer("ready", ready=ready))
            await asyncio.sleep(READY_EVERY_S)

    async def stop(self) -> None:
        if self._ready_task is not None:
            self._ready_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ready_task
        if self.server is not None:
            self.server.close()
        for conn in list(self.connections):
            conn.close()
            conn.transport.close()
        self.connections.clear()
