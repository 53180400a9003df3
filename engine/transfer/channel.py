"""Framing over one ucxx endpoint: control messages and block payloads, with ucxx errors mapped.

ucxx tag receives need a buffer of the message's exact size, so a control message goes as two
tag messages (8-byte length, then msgpack body). A batch's payloads go as the byte stream of its
blocks cut into messages of a few MiB (``ucx_payloads``), received into buffers the receiver
allocates from the header it already checked, so a sender can never make the receiver allocate
more than the header announced.

Must run on the event loop that drives ucxx (see ``loop_thread``). Every ucxx failure surfaces as
``PeerGone``; a ``Channel`` that raised is broken and must be aborted, never reused. Every ucxx
operation is posted through ``posted.post``: a caller that times out or is cancelled stops waiting,
but the operation (with its buffer) lives until ``abort`` makes UCX complete it.

A channel with a same-host ``lane`` (``shm_lane``) moves everything after the lane's setup through
it instead: payloads through its shared memory, control messages over its unix socket (length and
body, like the UCX framing). The methods keep their meaning, only the bytes take another road, one
that never waits on ucxx's progress and notifier threads.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Sequence

import msgspec
import numpy as np
from ucxx.exceptions import UCXError

from . import protocol, shm_lane, ucx_payloads
from .errors import LaneMismatch, PeerGone, ProtocolError, TransferTimeout
from .posted import post, start
from .shm_lane import LaneUnavailable, ShmLane

MAX_CONTROL_BYTES = 64 << 20
"""A control message larger than this is a protocol error (headers of ~100k blocks fit easily)."""
_PAYLOAD_TAG_BASE = 1 << 20  # keeps payload tags apart from the default control tag's hash input
_THREAD_COPY_BYTES = 1 << 20
"""Lane copies at least this large run on a worker thread, so the event loop (other connections,
the other slot's frame) goes on meanwhile; smaller ones cost less than the hop."""
MIN_LANE_CHUNK, MAX_LANE_CHUNK = 1 << 20, 64 << 20


class Channel:
    """One connection's framing. Not thread-safe; one request at a time per channel."""

    def __init__(self, endpoint: object, peer: str, slots: ucx_payloads.Slots | None = None) -> None:
        """``slots``: the copy slots of the server or client this connection belongs to (one pool
        per process role bounds their memory); a channel of its own makes its own."""
        self.ep = endpoint
        self.peer = peer
        self.broken = False
        self.received = 0
        """Control messages received so far (tells a stale connection from a peer that died mid-answer)."""
        self.lane: ShmLane | None = None
        """The same-host lane, once ``offer_lane``/``answer_lane`` set one up."""
        self._slots = slots if slots is not None else ucx_payloads.Slots()

    @property
    def alive(self) -> bool:
        """False once this side broke it or ucxx saw the peer go (its error callback ran)."""
        return not self.broken and self.ep is not None and not self.ep.closed

    # ---- control messages ---------------------------------------------------------------------
    async def send(self, msg: protocol.Message) -> None:
        """Post ``msg`` and return without waiting for UCX to report it sent: one endpoint delivers
        messages of one tag in the order they were posted, and every send here is followed by a
        receive (the answer) or a close (which flushes), either of which fails if the peer is
        gone. Waiting for the send's own completion cost a trip through ucxx's progress and
        notifier threads for every message, slow on a loaded 2-core machine. A send that
        fails marks the channel broken, so it is never reused."""
        if self.lane is not None:
            await self._lane_io(self.lane.send_message(protocol.encode(msg)))
            return
        body = np.frombuffer(protocol.encode(msg), np.uint8)
        ep = self._live()
        for part in (np.array([body.nbytes], np.uint64), body):
            start(ep.send(part)).add_done_callback(self._send_failed)

    def _send_failed(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is not None:
            self.broken = True

    async def recv(self, rest_timeout: float | None = None, max_bytes: int = MAX_CONTROL_BYTES) -> protocol.Message:
        """The next control message. ``rest_timeout``: how long its body may take once its length
        arrived (a peer that sends half a message and stalls gets ``TransferTimeout``);
        ``max_bytes``: the largest body accepted (a server allows little before authentication)."""
        if self.lane is not None:
            return self._decode(await self._lane_io(self.lane.recv_message(max_bytes, rest_timeout)))
        size = np.empty(1, np.uint64)
        await self._io(post(self._live().recv(size)), "waiting for a control message")
        n = int(size[0])
        if not 0 < n <= max_bytes:
            self.broken = True
            raise ProtocolError(f"{self.peer} announced a {n}-byte control message (limit {max_bytes})")
        body = np.empty(n, np.uint8)
        try:
            await asyncio.wait_for(self._io(post(self._live().recv(body)), "receiving a control message"),
                                   rest_timeout)
        except TimeoutError:
            self.broken = True
            raise TransferTimeout(f"{self.peer} sent {n} bytes' length and not the message within "
                                  f"{rest_timeout:.0f}s") from None
        return self._decode(body.data)

    def _decode(self, raw: bytes | memoryview) -> protocol.Message:
        self.received += 1
        try:
            return protocol.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.broken = True
            raise ProtocolError(f"undecodable control message from {self.peer}: {e}") from None

    async def _lane_io(self, aw):  # noqa: ANN001, ANN202 - a lane operation
        try:
            return await aw
        except BaseException:
            self.broken = True  # the bell's position is unknown: the connection is done
            raise

    async def expect(self, *types: type) -> protocol.Message:
        """Receive one message of one of ``types``; an ``ErrorReply`` is returned as is for the caller."""
        msg = await self.recv()
        if not isinstance(msg, (*types, protocol.ErrorReply)):
            self.broken = True
            raise ProtocolError(f"{self.peer} sent {type(msg).__name__}; expected "
                                f"{' or '.join(t.__name__ for t in types)}")
        return msg

    # ---- payloads -------------------------------------------------------------------------------
    async def send_payloads(self, arrays: Sequence[np.ndarray]) -> None:
        """Send the arrays' bytes, in order (the receiver cuts them by the sizes it expects)."""
        if self.lane is not None:
            await self._lane_io(self._lane_send(arrays))
            return
        await self._io(ucx_payloads.send(self._live(), arrays, _PAYLOAD_TAG_BASE, self._slots),
                       f"sending {len(arrays)} block payloads")

    async def recv_payloads_into(self, out: Sequence[np.ndarray]) -> None:
        """Receive one message into each of ``out`` (views of one buffer: a batch lands contiguous)."""
        if self.lane is not None:
            await self._lane_io(self._lane_recv(out))
            return
        await self._io(ucx_payloads.recv_into(self._live(), out, _PAYLOAD_TAG_BASE, self._slots),
                       f"receiving {len(out)} block payloads")

    async def recv_payloads(self, sizes: Sequence[int],
                            alloc: Callable[[int], np.ndarray] | None = None) -> list[np.ndarray]:
        """Receive one message per size into arrays from ``alloc`` (default: new ones); the block
        store keeps them."""
        alloc = alloc or (lambda n: np.empty(n, np.uint8))
        out = [alloc(n) for n in sizes]
        if self.lane is not None:
            await self._lane_io(self._lane_recv(out))
            return out
        await self._io(ucx_payloads.recv_into(self._live(), out, _PAYLOAD_TAG_BASE, self._slots),
                       f"receiving {len(sizes)} block payloads")
        return out

    # ---- the same-host lane ---------------------------------------------------------------------
    async def offer_lane(self, chunk_bytes: int = shm_lane.DEFAULT_CHUNK_BYTES) -> bool:
        """Client side, right after the handshake: propose a lane; True when the server took it.
        Any refusal (another host, no room, an older peer) leaves the channel on UCX alone."""
        size = shm_lane.SLOTS * chunk_bytes
        try:
            out_fd, nonce = shm_lane.create_memfd(size)
        except (LaneUnavailable, OSError):
            return False
        try:
            listener, name = shm_lane.listen()
        except LaneUnavailable:
            os.close(out_fd)
            return False
        exchange = asyncio.ensure_future(shm_lane.hand_over(listener, name, out_fd, nonce))
        try:
            await self.send(protocol.ShmOffer(name, nonce, chunk_bytes))
            reply = await self.expect(protocol.ShmAccept, protocol.ShmDecline)
            if isinstance(reply, protocol.ShmDecline):
                return False
            try:
                # The server sent its memfd before its answer: the exchange is done or about to be.
                peer = await asyncio.wait_for(exchange, shm_lane.EXCHANGE_TIMEOUT)
                mine, out_fd = out_fd, -1
                self.lane = shm_lane.join(mine, peer, reply.nonce, chunk_bytes)
            except (LaneUnavailable, ProtocolError, OSError, asyncio.TimeoutError):
                self.broken = True  # the server believes in a lane this side cannot use: start over
                raise LaneMismatch(f"{self.peer} answered with a lane this side cannot use") from None
            return True
        finally:
            if not exchange.done():
                exchange.cancel()  # closes and unlinks the socket
            elif not exchange.cancelled() and exchange.exception() is None and self.lane is None:
                exchange.result().close()  # handed over, not used (idempotent after a failed join)
            if out_fd >= 0:
                os.close(out_fd)

    async def answer_lane(self, offer: protocol.ShmOffer, allowed: bool) -> None:
        """Server side: take the client's lane when ``allowed`` and its socket is visible here."""
        reason = ""
        if not allowed:
            reason = "lanes are off on this server"
        elif self.lane is not None:
            reason = "this connection already has a lane"
        elif not MIN_LANE_CHUNK <= offer.chunk_bytes <= MAX_LANE_CHUNK:
            reason = f"chunk of {offer.chunk_bytes} bytes outside [{MIN_LANE_CHUNK}, {MAX_LANE_CHUNK}]"
        if reason:
            await self.send(protocol.ShmDecline(reason))
            return
        try:
            out_fd, nonce = shm_lane.create_memfd(shm_lane.SLOTS * offer.chunk_bytes)
        except (LaneUnavailable, OSError) as e:
            await self.send(protocol.ShmDecline(str(e)))
            return
        try:
            peer = await asyncio.wait_for(shm_lane.take_over(offer.name, out_fd, offer.nonce),
                                          shm_lane.EXCHANGE_TIMEOUT)
        except (LaneUnavailable, ProtocolError, OSError, asyncio.TimeoutError) as e:
            os.close(out_fd)
            await self.send(protocol.ShmDecline(str(e) or type(e).__name__))
            return
        try:
            lane = shm_lane.join(out_fd, peer, offer.nonce, offer.chunk_bytes)
        except (LaneUnavailable, ProtocolError) as e:
            await self.send(protocol.ShmDecline(str(e)))
            return
        await self.send(protocol.ShmAccept(nonce))  # over UCX: the client learns of the lane there
        self.lane = lane

    async def _lane_send(self, arrays: Sequence[np.ndarray]) -> None:
        lane = self.lane
        assert lane is not None
        chunks = shm_lane.plan([a.nbytes for a in arrays], lane.chunk_bytes)
        for i, chunk in enumerate(chunks):
            if i >= shm_lane.SLOTS:
                await lane.wait(shm_lane.ACK, i - shm_lane.SLOTS)  # its slot is free again
            views = [arrays[k][s:e] for k, s, e in chunk]
            n = await _copy(lane.write, i, views)
            await lane.ring(shm_lane.FRAME, i, n)
        for i in range(max(0, len(chunks) - shm_lane.SLOTS), len(chunks)):
            await lane.wait(shm_lane.ACK, i)

    async def _lane_recv(self, out: Sequence[np.ndarray]) -> None:
        lane = self.lane
        assert lane is not None
        for i, chunk in enumerate(shm_lane.plan([a.nbytes for a in out], lane.chunk_bytes)):
            views = [out[k][s:e] for k, s, e in chunk]
            await lane.wait(shm_lane.FRAME, i, sum(v.nbytes for v in views))
            await _copy(lane.read, i, views)
            await lane.ring(shm_lane.ACK, i)

    # ---- errors and teardown ------------------------------------------------------------------
    def _live(self):  # noqa: ANN202 - a ucxx Endpoint
        if self.ep is None or self.broken:
            raise PeerGone(f"connection to {self.peer} is already closed")
        return self.ep

    async def _io(self, aw, what: str):  # noqa: ANN001 - awaitable of any ucxx operation
        try:
            return await aw
        except UCXError as e:
            self.broken = True
            raise PeerGone(f"connection to {self.peer} failed while {what}: {type(e).__name__}: {e}") from None
        except asyncio.CancelledError:
            self.broken = True  # the stream position is unknown after a cancelled operation
            raise

    def abort(self) -> None:
        """Drop the connection now; outstanding requests are cancelled. Idempotent."""
        self.broken = True
        self._close_lane()
        ep, self.ep = self.ep, None
        if ep is not None:
            try:
                ep.abort()
            except UCXError:
                pass

    async def close(self) -> None:
        """Close cleanly (flushes what was sent); falls back to ``abort``."""
        ep, self.ep = self.ep, None
        self.broken = True
        self._close_lane()
        if ep is None:
            return
        try:
            await post(ep.close())
        except UCXError:
            ep.abort()

    def _close_lane(self) -> None:
        lane, self.lane = self.lane, None
        if lane is not None:
            lane.close()


async def _copy(fn, index: int, views: list[np.ndarray]) -> int:  # noqa: ANN001 - ShmLane.read/write
    if sum(v.nbytes for v in views) >= _THREAD_COPY_BYTES:
        # A cancelled waiter leaves the copy running; it holds ``views`` (and so their memory).
        return await asyncio.to_thread(fn, index, views)
    return fn(index, views)
