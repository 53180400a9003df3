"""Server side of the KV block protocol: a ucxx listener that feeds each request to a handler.

The server owns connections; the handler owns meaning. ``KVServer`` accepts a connection, checks
the ``Hello``, then loops: receive a request, ``await handler.handle(msg, channel)`` (the handler
sends the reply and any payloads itself, since a put is two-phase). A connection ends when the
peer goes away, sends garbage, or the server closes; a handler exception other than a
``TransferError`` is answered with ``ErrorReply(internal)`` and the connection is dropped.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from . import auth, protocol, shm_lane, ucx_payloads
from .auth import TokenSource, no_token
from .channel import Channel
from .errors import AuthFailed, PeerGone, ProtocolError, TransferError, TransferTimeout
from .listener import create_listener

log = logging.getLogger("kvmesh.transfer")

HANDSHAKE_BYTES = 4096
"""The largest Hello or Auth a server reads: nobody unauthenticated makes it allocate more."""


class RequestHandler(Protocol):
    async def handle(self, msg: protocol.Message, ch: Channel) -> None:
        """Answer one request on ``ch``; raise ``TransferError`` to drop the connection.

        A handler may also define ``connection_closed(ch)``, called once when ``ch`` ends."""


class KVServer:
    """Listens on ``host``:``port`` (0: any free port; read ``.port`` after ``start``); the default
    host binds every interface. Use on one event loop."""

    def __init__(self, handler: RequestHandler, port: int = 0, *, host: str = "0.0.0.0",
                 idle_timeout: float | None = None,
                 token: TokenSource = no_token, auth_timeout: float = 10.0,
                 message_timeout: float | None = 30.0, shm: bool | None = None, max_lanes: int = 64) -> None:
        """``token``: the deployment's internal token; when it gives one, a connection must prove
        it (transfer/auth.py) within ``auth_timeout`` seconds before any request is read.
        ``message_timeout``: a new connection's Hello, and the rest of any request once its length
        arrived, must come within it, or the connection is closed (counted in ``timeouts``): a
        peer cannot pin a connection with half a message. ``idle_timeout`` bounds the wait between
        requests (None: a connection may idle, as pooled clients' do). ``shm``: accept same-host
        lanes (``shm_lane``; default: on unless ``KVMESH_KV_SHM=0``), at most ``max_lanes`` at a
        time (each holds 2 x 32 MiB of shared memory)."""
        self.handler = handler
        self.message_timeout = message_timeout
        self.timeouts = 0
        self.token = token
        self.auth_timeout = auth_timeout
        self.auth_failures = 0
        self.requested_port = port
        self.host = host
        self.idle_timeout = idle_timeout
        self.shm = shm_lane.enabled_by_env() if shm is None else shm
        self.max_lanes = max_lanes
        self._copy_slots = ucx_payloads.Slots()  # every connection's payload copies share these
        self._listener = None
        self._channels: set[Channel] = set()
        self._tasks: set[asyncio.Task] = set()
        self.connections_total = 0

    @property
    def port(self) -> int:
        if self._listener is None:
            raise RuntimeError("KVServer.start() has not run")
        return self._listener.port

    @property
    def open_connections(self) -> int:
        return len(self._channels)

    @property
    def lanes(self) -> int:
        """Open connections that move payloads through a same-host lane."""
        return sum(1 for ch in self._channels if ch.lane is not None)

    async def start(self) -> None:
        # No handshake timeout: ucxx abandons a timed-out handshake while its receive stays posted
        # into a freed buffer (see posted.py); a client that stalls mid-handshake holds one pending
        # accept until it resumes or its connection fails.
        self._listener = create_listener(self._on_connect, self.host, self.requested_port)
        log.info("KV transfer: listening on UCX %s:%d", self.host, self._listener.port)

    async def _on_connect(self, ep: object) -> None:
        self._tasks.add(asyncio.current_task())
        ch = Channel(ep, "client", self._copy_slots)
        self._channels.add(ch)
        self.connections_total += 1
        try:
            hello = await asyncio.wait_for(ch.recv(self.message_timeout, HANDSHAKE_BYTES), self.message_timeout)
            if not isinstance(hello, protocol.Hello):
                raise ProtocolError(f"expected Hello, got {type(hello).__name__}")
            token = self.token()
            mine = auth.nonce() if token else b""
            shown = auth.proof(token, auth.SERVER, hello.nonce, mine) if token and hello.nonce else b""
            await ch.send(protocol.Hello(protocol.PROTOCOL_VERSION, "server", mine, shown))
            if hello.version != protocol.PROTOCOL_VERSION:
                raise ProtocolError(f"client speaks KV protocol {hello.version}, server {protocol.PROTOCOL_VERSION}")
            if token:
                await self._check_proof(ch, token, mine, hello.nonce)
            while True:
                msg = await asyncio.wait_for(ch.recv(self.message_timeout), self.idle_timeout)
                if isinstance(msg, protocol.ShmOffer):
                    await ch.answer_lane(msg, self.shm and self.lanes < self.max_lanes)
                    continue
                await self.handler.handle(msg, ch)
        except PeerGone:
            pass  # the client closed or died: the normal end of a connection
        except (TransferTimeout, TimeoutError) as e:
            self.timeouts += 1
            log.warning("KV transfer: dropping a stalled connection: %s", e or "no message in time")
        except TransferError as e:
            log.warning("KV transfer: dropping a connection: %s", e)
        except asyncio.CancelledError:
            pass
        except Exception as e:  # a handler bug must not kill the listener; tell the client if we can
            log.exception("KV transfer: request handler failed")
            try:
                await asyncio.wait_for(ch.send(protocol.ErrorReply(protocol.ERR_INTERNAL, str(e))), 1.0)
            except (TransferError, TimeoutError):
                pass
        finally:
            self._channels.discard(ch)
            ch.abort()
            closed = getattr(self.handler, "connection_closed", None)
            if closed is not None:
                closed(ch)
            self._tasks.discard(asyncio.current_task())

    async def _check_proof(self, ch: Channel, token: str, mine: bytes, theirs: bytes) -> None:
        """The client's Auth must prove the token over both nonces; anything else closes the
        connection (answered ``unauthorized``, counted in ``auth_failures``)."""
        try:
            msg = await asyncio.wait_for(ch.recv(self.auth_timeout, HANDSHAKE_BYTES), self.auth_timeout)
        except TimeoutError:
            msg = None
        if isinstance(msg, protocol.Auth) and auth.valid(token, auth.CLIENT, mine, theirs, msg.proof):
            await ch.send(protocol.AuthOk())
            return
        self.auth_failures += 1
        try:
            await asyncio.wait_for(ch.send(protocol.ErrorReply(
                protocol.ERR_UNAUTHORIZED, "this KV server needs the deployment's internal token "
                                           "(--auth-token-file)")), 1.0)
        except (TransferError, TimeoutError):
            pass
        raise AuthFailed(f"a connection did not prove the internal token "
                         f"(sent {type(msg).__name__ if msg is not None else 'nothing in time'})")

    async def close(self) -> None:
        """Abort every connection, then stop listening (endpoints go before their listener)."""
        for ch in list(self._channels):
            ch.abort()
        tasks = [t for t in self._tasks if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
