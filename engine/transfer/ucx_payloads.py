"""Block payloads over one ucxx endpoint, coalesced into messages of a few MiB.

A KV block is a few hundred KiB; sent as a message each, a batch pays Python's and UCX's
per-message work hundreds of times (a third of the engine side's CPU per GB over TCP:
docs/benchmarks.md, "KV transfer"). So a batch's payloads travel as the byte stream of the arrays
in order, cut by ``shm_lane.plan`` into chunks of ``CHUNK_BYTES``; both ends compute the same plan
from sizes they already agreed on (the checked header), so a chunk's size is known before it
arrives and a sender can never make a receiver take more. (A message longer than its buffer fails
the receive; ucxx reports a shorter one as a success, so only a peer that breaks the protocol can
send one, and that is no worse than wrong bytes from a peer holding the token: UCX never delivers
part of a message from a peer that dies mid-send.)

Each end maps a chunk onto its own memory: pieces that lie back to back in one buffer (a batch
gathered from the KV cache, a fetch landing in one staging buffer) go straight from or into that
memory; scattered ones (a cache node's stored blocks) are copied through a slot of a ``Slots``
pool that a whole server or client shares, so the copy memory is bounded per process, not per
connection. Message ``i`` carries tag ``tag_base + i``, so several are in flight at once.

Invariants: at most ``WINDOW`` messages are posted per call at any time; a slot goes back to its
pool only once UCX completed the message using it (and, receiving, once its bytes were copied
out or the call failed); every posted operation goes through ``posted.start``, so a caller that
stops waiting never frees memory UCX still writes (see posted.py).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence

import numpy as np

from .buffers import as_bytes, covering
from .posted import start
from .shm_lane import plan

CHUNK_BYTES = 4 << 20
"""Bytes per message; the last one of a batch may be shorter."""
WINDOW = 16
"""Messages in flight per direction and call."""
COPY_SLOTS = 4
"""Chunk-sized buffers a pool copies scattered pieces through (allocated on first need)."""


class Slots:
    """Copy slots shared by the channels of one event loop: at most ``count`` buffers of
    ``chunk_bytes``, made on first use. ``chunk_bytes`` is also the chunk size of every channel
    using the pool (both ends' plans use it)."""

    def __init__(self, chunk_bytes: int | None = None, count: int = COPY_SLOTS) -> None:
        self.chunk_bytes = chunk_bytes or CHUNK_BYTES
        self.count = count
        self._bufs: list[np.ndarray] = []
        self._free: list[int] = []
        self._waiters: deque[asyncio.Future[int]] = deque()

    @property
    def allocated_bytes(self) -> int:
        return sum(b.nbytes for b in self._bufs)

    def try_take(self) -> int | None:
        """A free slot now, or None when all ``count`` are taken."""
        if self._free:
            return self._free.pop()
        if len(self._bufs) < self.count:
            self._bufs.append(np.empty(self.chunk_bytes, np.uint8))
            return len(self._bufs) - 1
        return None

    async def take(self) -> int:
        """A slot, waiting for another channel to give one back when all are taken."""
        slot = self.try_take()
        if slot is not None:
            return slot
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # handed over as we were cancelled: pass it on
                self.give(fut.result())
            raise

    def give(self, slot: int) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(slot)
                return
        self._free.append(slot)

    def give_when_done(self, task: asyncio.Task, slot: int) -> None:
        """Give ``slot`` back once ``task`` (the UCX operation using it) has completed."""
        task.add_done_callback(lambda _t: self.give(slot))

    def buf(self, slot: int, nbytes: int) -> np.ndarray:
        return self._bufs[slot][:nbytes]


def _chunks(arrays: Sequence[np.ndarray], chunk_bytes: int) -> list[list[np.ndarray]]:
    flats = [as_bytes(a) for a in arrays]
    return [[flats[k][s:e] for k, s, e in chunk] for chunk in plan([f.nbytes for f in flats], chunk_bytes)]


async def send(ep: object, arrays: Sequence[np.ndarray], tag_base: int, slots: Slots) -> None:
    """Send the bytes of ``arrays`` (in order) as chunk messages. Raises ucxx's error on failure."""
    inflight: deque[asyncio.Task] = deque()
    for i, views in enumerate(_chunks(arrays, slots.chunk_bytes)):
        buf, slot = covering(views), None
        if buf is None:
            # Waiting is safe: the slots this call holds come back as its messages complete.
            slot = await slots.take()
            buf = slots.buf(slot, sum(v.nbytes for v in views))
            np.concatenate(views, out=buf)
        task = start(ep.send(buf, tag=tag_base + i))
        if slot is not None:
            slots.give_when_done(task, slot)
        inflight.append(task)
        if len(inflight) >= WINDOW:
            await asyncio.shield(inflight.popleft())
    while inflight:
        await asyncio.shield(inflight.popleft())


async def recv_into(ep: object, out: Sequence[np.ndarray], tag_base: int, slots: Slots) -> None:
    """Receive chunk messages into ``out`` (in order). Raises ucxx's error on failure (and on a
    message of another size than planned)."""
    todo = deque(enumerate(_chunks(out, slots.chunk_bytes)))
    inflight: deque[tuple[asyncio.Task, list[np.ndarray], int | None]] = deque()
    try:
        while todo or inflight:
            while todo and len(inflight) < WINDOW:
                i, views = todo[0]
                buf, slot = covering(views), None
                if buf is None:
                    # Only this call gives back the slots its receives hold (after copying out),
                    # so it waits for one only while it holds none.
                    slot = slots.try_take() if inflight else await slots.take()
                    if slot is None:
                        break
                    buf = slots.buf(slot, sum(v.nbytes for v in views))
                todo.popleft()
                inflight.append((start(ep.recv(buf, tag=tag_base + i)), views, slot))
            task, views, slot = inflight[0]
            await asyncio.shield(task)
            inflight.popleft()
            if slot is not None:
                _scatter(slots.buf(slot, sum(v.nbytes for v in views)), views)
                slots.give(slot)
    except BaseException:
        for task, _, slot in inflight:  # failed or cancelled: the bytes no longer matter
            if slot is not None:
                slots.give_when_done(task, slot)
        raise


def _scatter(buf: np.ndarray, views: Sequence[np.ndarray]) -> None:
    pos = 0
    for v in views:
        np.copyto(v, buf[pos:pos + v.nbytes])
        pos += v.nbytes
