"""Follow one KV event publisher (asyncio): PUB stream, replay on gaps, HTTP snapshot on resync.

Usage (a router keeps one per engine)::

    mirror = KVCacheMirror()
    sub = KVEventSubscriber("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558",
                            "http://10.0.0.5:8000/kv/snapshot",
                            on_event=mirror.on_event, on_reset=mirror.reset)
    task = asyncio.create_task(sub.run())
    await sub.synced.wait()          # the first snapshot is applied
    ...
    await sub.stop()                 # run() returns

Protocol (layout: ``event_wire``):

1. Subscribe first, then fetch the snapshot, so nothing published after the snapshot can be
   missed: a reader task buffers every message while the snapshot is in flight.
2. ``on_reset(snapshot)``; then apply buffered and new records with seq > snapshot.seq in order.
3. A record whose seq skips ahead is a gap: ask the replay socket for everything from the first
   missing seq. If the answer does not start exactly there (the ring moved on), or no answer
   comes within ``replay_timeout_s``, resync from the snapshot (step 2).
4. A publisher restart (the topic names another engine id, or the PUB seq goes backwards) also
   resyncs; messages still buffered from the engine it replaced are ignored.

Invariants:

* ``on_event`` sees records of one engine instance in strictly increasing seq order with no
  gap since the last ``on_reset``: ``last_seq`` moves by exactly one per wire record (a wire
  batch holding several events, as vLLM publishers send, gives several calls with one seq).
* After ``on_reset(s)`` and the ``on_event`` calls that follow, the caller's state equals the
  engine's cache at ``last_seq`` (the ``KVEventLog`` invariant), provided it applies events as
  ``KVCacheMirror`` does.
* Callbacks run on the event loop and must not block; an exception in one ends ``run()``.

A record lost at the very end of a stream (or every record of a burst sent before the SUB
socket's subscription reached the publisher) leaves no later one to reveal the gap: a follower
that heard nothing for ``idle_poll_s`` asks the replay socket for what follows ``last_seq``, so an
idle engine's subscribers still converge.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import zmq
import zmq.asyncio

from .event_wire import (
    WireFormatError,
    decode_payload,
    engine_of_topic,
    seq_bytes,
    seq_from_bytes,
    snapshot_from_json,
    to_internal,
)
from .event_auth import curve_keys, secure_client
from .events import KVEventRecord, KVSnapshot
from .kv_mirror import KVCacheMirror

log = logging.getLogger("kvmesh.kv.subscriber")

OnEvent = Callable[[str, KVEventRecord], None]
OnReset = Callable[[KVSnapshot], None]

__all__ = ["KVCacheMirror", "KVEventSubscriber", "SubscriberStats", "KVEventEndpoints", "endpoints_from_info"]


@dataclass(frozen=True)
class KVEventEndpoints:
    pub: str
    replay: str
    snapshot_url: str


def endpoints_from_info(engine_url: str, info: dict[str, Any]) -> KVEventEndpoints | None:
    """Where to subscribe to the engine at ``engine_url`` given its ``GET /kv/info`` body.

    The host comes from ``engine_url`` (the publisher often binds 0.0.0.0); None when the
    engine publishes no events.
    """
    ports = info.get("kv_events")
    if not ports:
        return None
    parts = urlsplit(engine_url)
    host = parts.hostname or "127.0.0.1"
    zhost = f"[{host}]" if ":" in host else host
    return KVEventEndpoints(f"tcp://{zhost}:{ports['port']}", f"tcp://{zhost}:{ports['replay_port']}",
                            engine_url.rstrip("/") + "/kv/snapshot")


@dataclass
class SubscriberStats:
    applied: int = 0
    """Wire records applied from the PUB stream or from replay answers."""
    duplicates: int = 0
    """Records skipped because the snapshot or a replay already covered them."""
    gaps: int = 0
    replays: int = 0
    """Gaps closed by a replay answer."""
    replayed: int = 0
    """Records applied from replay answers."""
    resyncs: int = 0
    """Snapshots applied, the first one included."""
    restarts: int = 0
    """Publisher restarts noticed (new engine id, or the seq went backwards)."""
    dropped: int = 0
    """Messages discarded by the ``drop`` test hook."""
    idle_polls: int = 0
    """Replay requests for what follows ``last_seq`` after ``idle_poll_s`` of silence."""
    tail_repairs: int = 0
    """Idle polls that found records the stream had lost."""


class KVEventSubscriber:
    """Keeps ``on_event``/``on_reset`` in step with one publisher (see the module doc)."""

    def __init__(self, pub_endpoint: str, replay_endpoint: str, snapshot_url: str,
                 on_event: OnEvent, on_reset: OnReset, *, replay_timeout_s: float = 2.0,
                 http_timeout_s: float = 5.0, retry_s: float = 1.0, buffer_limit: int = 100_000,
                 drop: Callable[[int], bool] | None = None, session: aiohttp.ClientSession | None = None,
                 token: str | None = None, idle_poll_s: float = 5.0) -> None:
        """``session``: the process's HTTP client for snapshots (a router passes its own, so one
        client and one connection pool serve every engine); without one the subscriber opens and
        closes its own. ``token``: the deployment's internal token, for a publisher that serves
        CURVE-authenticated subscribers only (kv/event_auth.py). ``idle_poll_s``: silence after which
        the follower asks the replay socket for records the stream lost at its end (one small
        request per idle period). ``drop`` is a test hook: PUB messages whose seq it accepts are
        discarded as if lost."""
        self.pub_endpoint = pub_endpoint
        self.replay_endpoint = replay_endpoint
        self.snapshot_url = snapshot_url
        self.on_event = on_event
        self.on_reset = on_reset
        self.replay_timeout_s = replay_timeout_s
        self.http_timeout_s = http_timeout_s
        self.retry_s = retry_s
        self.idle_poll_s = idle_poll_s
        self.drop = drop
        self.stats = SubscriberStats()
        self.synced = asyncio.Event()
        """Set once the first snapshot is applied (a router reports ready after that)."""
        self.engine_id: str | None = None
        self.last_seq = 0
        # Oldest messages fall out first when the buffer overflows: a gap that replay repairs.
        self._buf: deque[tuple[bytes, int, bytes]] = deque(maxlen=buffer_limit)
        self._arrived = asyncio.Event()
        self._pub_high: int | None = None  # highest seq seen on PUB from the current engine
        self._replay_skipped = False  # the last replay answer skipped records (the ring moved on)
        self._retired: set[str] = set()
        self._ctx: zmq.asyncio.Context | None = None
        self._dealer: zmq.asyncio.Socket | None = None
        self._session = session
        self._keys = curve_keys(token) if token else None
        self._http: aiohttp.ClientSession | None = None
        self._main: asyncio.Task | None = None
        self._stopping = False

    @classmethod
    def from_info(cls, engine_url: str, info: dict[str, Any], on_event: OnEvent, on_reset: OnReset,
                  **kwargs: Any) -> KVEventSubscriber | None:
        """A subscriber for the engine at ``engine_url`` from its ``/kv/info``; None when it publishes nothing."""
        ep = endpoints_from_info(engine_url, info)
        return None if ep is None else cls(ep.pub, ep.replay, ep.snapshot_url, on_event, on_reset, **kwargs)

    # ---- lifecycle --------------------------------------------------------------------------------
    async def run(self) -> None:
        """Follow the publisher until ``stop()``; retries the snapshot while the engine is unreachable."""
        if self._main is not None:
            raise RuntimeError("KVEventSubscriber.run() called twice")
        self._main = asyncio.ensure_future(self._follow())
        try:
            await self._main
        except asyncio.CancelledError:
            if not self._stopping:
                raise

    async def stop(self) -> None:
        """Make ``run()`` return and release the sockets.

        Cancels until the follower has ended, not once: on Python 3.11 ``asyncio.wait_for`` (the
        replay's receive) can swallow a cancellation that lands as its inner future completes, and
        the follower would then wait for events forever."""
        self._stopping = True
        main = self._main
        while main is not None and not main.done():
            main.cancel()
            await asyncio.wait({main}, timeout=0.5)
        if main is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await main

    async def resync(self, reason: str = "requested") -> None:
        """Replace the caller's state from the snapshot now (call from the loop running ``run()``)."""
        await self._resync(reason)

    # ---- the follower ----------------------------------------------------------------------------
    async def _follow(self) -> None:
        self._ctx = ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        if self._keys is not None:
            secure_client(sub, self._keys)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 0)  # our own buffer bounds memory (buffer_limit)
        # Everything: one publisher per endpoint, and vLLM publishers default to an empty topic.
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.pub_endpoint)
        reader = asyncio.ensure_future(self._read(sub))
        self._http = self._session or aiohttp.ClientSession()
        try:
            await self._resync("start")
            while True:
                while not self._buf:
                    if reader.done():
                        reader.result()  # re-raise what ended the reader
                    self._arrived.clear()
                    try:
                        await asyncio.wait_for(self._arrived.wait(), self.idle_poll_s)
                    except asyncio.TimeoutError:
                        await self._poll_tail()
                topic, seq, payload = self._buf.popleft()
                await self._handle(topic, seq, payload)
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, zmq.ZMQError):
                await reader
            if self._http is not self._session:
                await self._http.close()
            sub.close(0)
            self._close_dealer()
            ctx.term()

    async def _read(self, sub: zmq.asyncio.Socket) -> None:
        try:
            await self._read_forever(sub)
        finally:
            self._arrived.set()  # let the follower notice that the reader ended

    async def _read_forever(self, sub: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sub.recv_multipart()
            if len(frames) != 3:
                log.warning("ignoring a KV event message of %d frames (expected 3)", len(frames))
                continue
            topic, raw_seq, payload = frames
            try:
                seq = seq_from_bytes(raw_seq)
            except WireFormatError as e:
                log.warning("ignoring a KV event message: %s", e)
                continue
            if self.drop is not None and self.drop(seq):
                self.stats.dropped += 1
                continue
            self._buf.append((topic, seq, payload))
            self._arrived.set()

    async def _handle(self, topic: bytes, seq: int, payload: bytes) -> None:
        engine = engine_of_topic(topic) or self.engine_id or ""
        if engine in self._retired:
            return
        if engine != self.engine_id:
            self.stats.restarts += 1
            await self._resync(f"publisher now serves engine {engine!r}")
            if engine != self.engine_id:
                return  # the snapshot names yet another engine; its own messages will follow
        elif self._pub_high is not None and seq <= self._pub_high:
            self.stats.restarts += 1
            await self._resync(f"seq went back from {self._pub_high} to {seq}")
        self._pub_high = seq
        if seq <= self.last_seq:
            self.stats.duplicates += 1
            return
        if seq > self.last_seq + 1:
            self.stats.gaps += 1
            if await self._replay(self.last_seq + 1, seq):
                self.stats.replays += 1
            else:
                await self._resync(f"records {self.last_seq + 1}..{seq - 1} are no longer in the replay buffer")
            if seq <= self.last_seq:
                return
            if seq != self.last_seq + 1:
                log.warning("KV events: snapshot at seq %d is older than record %d; waiting for the next gap",
                            self.last_seq, seq)
                return
        await self._apply(engine, seq, payload)

    async def _apply(self, engine: str, seq: int, payload: bytes) -> None:
        try:
            batch = decode_payload(payload)
            events = [to_internal(ev) for ev in batch.events]
        except WireFormatError as e:
            await self._resync(f"undecodable record {seq}: {e}")
            return
        for ev in events:
            self.on_event(engine, KVEventRecord(seq, engine, batch.ts, ev))
        self.last_seq = seq
        self.stats.applied += 1

    async def _poll_tail(self) -> None:
        """Nothing arrived for ``idle_poll_s``: apply whatever the replay socket holds after
        ``last_seq`` (records the stream lost at its end); resync where it no longer holds them.
        A publisher that does not answer is tried again at the next idle poll."""
        if self.engine_id is None:
            return
        self.stats.idle_polls += 1
        before = self.last_seq
        if not await self._replay(before + 1, 0, quiet=True):
            return
        if self._replay_skipped:
            await self._resync(f"records after {before} are no longer in the replay buffer")
        elif self.last_seq > before:
            self.stats.tail_repairs += 1
            log.info("KV events: %d record(s) after seq %d came by replay only", self.last_seq - before, before)

    async def _replay(self, first: int, upto: int, quiet: bool = False) -> bool:
        """Apply records ``first..`` from the replay socket; True when they reach ``upto - 1``
        (``_replay_skipped`` then says whether the answer skipped past ``last_seq + 1``).
        ``quiet``: a publisher that does not answer is logged at debug level only."""
        if self._dealer is None:
            assert self._ctx is not None
            self._dealer = self._ctx.socket(zmq.DEALER)
            if self._keys is not None:
                secure_client(self._dealer, self._keys)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.connect(self.replay_endpoint)
        dealer = self._dealer
        # vLLM's framing (empty delimiter first), which kvmesh publishers accept too.
        await dealer.send_multipart([b"", seq_bytes(first)])
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.replay_timeout_s
        in_order = True
        self._replay_skipped = False
        try:
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), max(0.0, deadline - loop.time()))
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) != 2:
                    raise WireFormatError(f"a replay answer has a seq and a payload frame, got {len(frames)}")
                seq = seq_from_bytes(frames[0])
                if seq < 0:
                    break
                if seq <= self.last_seq:
                    continue
                if seq != self.last_seq + 1:
                    in_order = False  # the ring no longer holds what we miss; read on to the end marker
                    self._replay_skipped = True
                if in_order and self.engine_id is not None:
                    await self._apply(self.engine_id, seq, frames[1])
                    self.stats.replayed += 1
        except (TimeoutError, WireFormatError) as e:
            (log.debug if quiet else log.warning)("KV event replay from %s failed: %s", self.replay_endpoint,
                                                  str(e) or "no answer in time")
            self._close_dealer()  # a late answer must not be read as the next one
            return False
        return self.last_seq >= upto - 1

    def _close_dealer(self) -> None:
        if self._dealer is not None:
            self._dealer.close(0)
            self._dealer = None

    async def _resync(self, reason: str) -> None:
        assert self._http is not None
        self.stats.resyncs += 1
        log.info("KV events: resync from %s (%s)", self.snapshot_url, reason)
        timeout = aiohttp.ClientTimeout(total=self.http_timeout_s)
        while True:
            try:
                async with self._http.get(self.snapshot_url, timeout=timeout) as r:
                    r.raise_for_status()
                    snap = snapshot_from_json(json.loads(await r.read()))
                break
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:  # WireFormatError, JSON errors
                log.warning("KV snapshot from %s failed: %s; retrying in %.1fs", self.snapshot_url, e, self.retry_s)
                await asyncio.sleep(self.retry_s)
        if self.engine_id is not None and snap.engine_id != self.engine_id:
            self._retired.add(self.engine_id)
            self._pub_high = None
        self.engine_id = snap.engine_id
        self.last_seq = snap.seq
        self.on_reset(snap)
        self.synced.set()
