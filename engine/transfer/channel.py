"""Framing over one ucxx endpoint: control messages and block payloads, with ucxx errors mapped.

ucxx tag receives need a buffer of the message's exact size, so a control message goes as two
tag messages (8-byte length, then msgpack body). A block payload goes as one tag message into a
buffer the receiver allocates from the header it already checked, so a sender can never make the
receiver allocate more than the header announced. Payload messages carry their index in the batch
as the tag, so several may be in flight at once without relying on matching order.

Must run on the event loop that drives ucxx (see ``loop_thread``). Every ucxx failure surfaces as
``PeerGone``; a ``Channel`` that raised is broken and must be aborted, never reused. Every ucxx
operation is posted through ``posted.post``: a caller that times out or is cancelled stops waiting,
but the operation (with its buffer) lives until ``abort`` makes UCX complete it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import msgspec
import numpy as np
from ucxx.exceptions import UCXError

from . import protocol
from .posted import post
from .errors import PeerGone, ProtocolError, TransferTimeout

MAX_CONTROL_BYTES = 64 << 20
"""A control message larger than this is a protocol error (headers of ~100k blocks fit easily)."""
PAYLOAD_WINDOW = 64
"""Payload messages in flight per direction: enough to keep the wire busy, bounded so a huge batch
does not post thousands of requests at once."""
_PAYLOAD_TAG_BASE = 1 << 20  # keeps payload tags apart from the default control tag's hash input


class Channel:
    """One connection's framing. Not thread-safe; one request at a time per channel."""

    def __init__(self, endpoint: object, peer: str) -> None:
        self.ep = endpoint
        self.peer = peer
        self.broken = False
        self.received = 0
        """Control messages received so far (tells a stale connection from a peer that died mid-answer)."""

    @property
    def alive(self) -> bool:
        """False once this side broke it or ucxx saw the peer go (its error callback ran)."""
        return not self.broken and self.ep is not None and not self.ep.closed

    # ---- control messages ---------------------------------------------------------------------
    async def send(self, msg: protocol.Message) -> None:
        body = np.frombuffer(protocol.encode(msg), np.uint8)
        await self._io(self._send_two(body), "sending a control message")

    async def _send_two(self, body: np.ndarray) -> None:
        ep = self._live()
        await post(ep.send(np.array([body.nbytes], np.uint64)))
        await post(ep.send(body))

    async def recv(self, rest_timeout: float | None = None, max_bytes: int = MAX_CONTROL_BYTES) -> protocol.Message:
        """The next control message. ``rest_timeout``: how long its body may take once its length
        arrived (a peer that sends half a message and stalls gets ``TransferTimeout``);
        ``max_bytes``: the largest body accepted (a server allows little before authentication)."""
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
        self.received += 1
        try:
            return protocol.decode(body.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.broken = True
            raise ProtocolError(f"undecodable control message from {self.peer}: {e}") from None

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
        """Send each array as one tag message (tag = its index), at most ``PAYLOAD_WINDOW`` at once."""
        ep = self._live()
        await self._io(self._windowed([ep.send(a, tag=_PAYLOAD_TAG_BASE + i) for i, a in enumerate(arrays)]),
                       f"sending {len(arrays)} block payloads")

    async def recv_payloads_into(self, out: Sequence[np.ndarray]) -> None:
        """Receive one message into each of ``out`` (views of one buffer: a batch lands contiguous)."""
        ep = self._live()
        await self._io(self._windowed([ep.recv(a, tag=_PAYLOAD_TAG_BASE + i) for i, a in enumerate(out)]),
                       f"receiving {len(out)} block payloads")

    async def recv_payloads(self, sizes: Sequence[int]) -> list[np.ndarray]:
        """Receive one message per size into freshly allocated arrays (the block store keeps them)."""
        out = [np.empty(n, np.uint8) for n in sizes]
        ep = self._live()
        await self._io(self._windowed([ep.recv(a, tag=_PAYLOAD_TAG_BASE + i) for i, a in enumerate(out)]),
                       f"receiving {len(sizes)} block payloads")
        return out

    @staticmethod
    async def _windowed(coros: list) -> None:
        # Coroutines are started in index order, window by window; each posts its ucxx request on
        # its first step, so requests are posted in order and matched by their distinct tags. A
        # failed window leaves its other operations posted: the caller's abort completes them.
        for start in range(0, len(coros), PAYLOAD_WINDOW):
            batch = [post(c) for c in coros[start:start + PAYLOAD_WINDOW]]
            try:
                await asyncio.gather(*batch)
            except BaseException:
                for c in coros[start + PAYLOAD_WINDOW:]:
                    c.close()  # never started: close so Python does not warn about them
                raise

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
        if ep is None:
            return
        try:
            await post(ep.close())
        except UCXError:
            ep.abort()
