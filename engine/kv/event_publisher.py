"""Publish a ``KVEventLog`` over ZeroMQ: a PUB stream and a replay socket (layout: ``event_wire``).

Any process that owns a ``KVEventLog`` (an engine, later a cache node) runs one
``KVEventPublisher``; it knows nothing about HTTP, so the snapshot route lives elsewhere.

Threads and ownership:

* The engine thread only calls ``KVEventLog.publish``, which appends to the ring and notifies a
  condition. It never touches a socket, never waits for a reader, and pays nothing per event
  for a slow or absent subscriber.
* The stream thread owns the PUB socket. It sleeps in ``KVEventLog.wait_since`` and sends every
  new record, in seq order, as ``[topic, seq, payload]`` (one record per message). PUB drops
  messages for a subscriber whose queue is full rather than blocking; the subscriber sees the
  seq gap and asks the replay socket.
* The replay thread owns the ROUTER socket (PUB port + 1). For a request naming seq N it answers
  the records still in the ring from N on, as many as ``ReplayBudget`` grants that subscriber,
  then ``REPLAY_END``; when N is older than the ring it answers from the ring's oldest record
  (the asker sees the skip and uses the snapshot), when N is ahead of the log only ``REPLAY_END``. It sends the payloads the stream thread
  already encoded, so a replay costs sends, not encoding, next to the step thread. A subscriber
  that does not read fills its bounded queue and its answer is cut off (it times out and resyncs).

Invariants: the stream thread sends each record at most once and in increasing seq order; if
it falls so far behind that the ring dropped records it has not sent, it skips to the oldest
record still held (subscribers see a gap and resync from the snapshot). ``close()`` stops both
threads and releases both ports; it is idempotent.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

import zmq

from .event_auth import curve_keys, secure_server
from .event_wire import REPLAY_END, TopicScheme, encode_record, seq_from_bytes, WireFormatError
from .events import KVEventLog, KVEventRecord
from .replay_budget import ReplayBudget, ReplayLimits

logger = logging.getLogger("kvmesh.kv.events")

_WAIT_S = 0.5  # how often the idle stream thread looks at the stop flag (close() also wakes it)
_POLL_MS = 100  # the replay thread's poll: bounds how long close() waits for it
_PUB_HWM = 100_000  # messages queued per subscriber before PUB drops (a gap the subscriber repairs)


class KVEventsBindError(OSError):
    """The publisher could not bind its PUB or replay port; the message names the port and the fix."""


@dataclass
class PublisherStats:
    sent: int = 0
    """Records handed to the PUB socket."""
    skipped: int = 0
    """Records the stream thread never sent because the ring dropped them first."""
    replay_requests: int = 0
    replayed: int = 0
    """Records sent in replay answers."""
    replay_limited: int = 0
    """Replay answers cut short by the budget (the subscriber resyncs from the snapshot)."""
    replay_dropped: int = 0
    """Replay answers abandoned because the subscriber's queue was full or it was gone."""


def _endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class KVEventPublisher:
    """Serves one ``KVEventLog`` on ``host``: PUB on ``port``, replay ROUTER on ``port + 1``.

    Use ``bind()`` early (it fails fast on a busy port, before a model spends minutes loading),
    then ``start(log)`` once the log exists, and ``close()`` on shutdown; or use it as a context
    manager around ``start``. ``port`` 0 is refused: the replay port must be predictable.
    """

    def __init__(self, host: str, port: int, token: str | None = None, token_ids: bool = False,
                 replay_limits: ReplayLimits | None = None, scheme: TopicScheme | None = None) -> None:
        """``token``: the deployment's internal token; with it both sockets serve CURVE-authenticated
        subscribers only (kv/event_auth.py). ``token_ids``: put the blocks' token ids in
        ``BlockStored`` (some external indexers need them; they reveal every tenant's prompts and
        completions to every subscriber, so they are off unless asked for). ``scheme``: the topic
        (kvmesh's by default; llm-d's names the pod and the model, see event_wire)."""
        self.token_ids = token_ids
        self.scheme = scheme or TopicScheme()
        self._topic: bytes | None = None
        self.budget = ReplayBudget(replay_limits or ReplayLimits())
        self._encoded: deque[tuple[int, bytes, bytes]] = deque()
        self._encoded_lock = threading.Lock()
        if not 1 <= port <= 65534:
            raise ValueError(f"KV events port must be in 1..65534 (the replay socket takes port + 1), got {port}")
        self.host = host
        self.port = port
        self.replay_port = port + 1
        self.keys = curve_keys(token) if token else None
        self._zap: object | None = None
        self.stats = PublisherStats()
        self.log: KVEventLog | None = None
        self._ctx: zmq.Context | None = None
        self._pub: zmq.Socket | None = None
        self._router: zmq.Socket | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._closed = False

    @property
    def endpoint(self) -> str:
        return _endpoint(self.host, self.port)

    @property
    def replay_endpoint(self) -> str:
        return _endpoint(self.host, self.replay_port)

    @property
    def topic(self) -> bytes | None:
        """The topic every message carries; None until ``start``."""
        return self._topic

    # ---- lifecycle ----------------------------------------------------------------------------
    def bind(self) -> None:
        """Bind both sockets now; raises ``KVEventsBindError`` if either port is unavailable."""
        if self._ctx is not None:
            return
        if self._closed:
            raise RuntimeError("this KVEventPublisher was closed; create a new one")
        ctx = zmq.Context()
        pub = ctx.socket(zmq.PUB)
        router = ctx.socket(zmq.ROUTER)
        for sock in (pub, router):
            sock.setsockopt(zmq.LINGER, 0)
            if ":" in self.host:
                sock.setsockopt(zmq.IPV6, 1)
        if self.keys is not None:
            self._zap = secure_server(ctx, [pub, router], self.keys)
        pub.setsockopt(zmq.SNDHWM, _PUB_HWM)
        # One answer fits a peer's queue; a peer that does not read makes the next send fail
        # (ROUTER_MANDATORY) instead of growing memory or being dropped silently mid-answer.
        router.setsockopt(zmq.SNDHWM, self.budget.limits.max_records + 8)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            for sock, port, what in ((pub, self.port, "PUB"), (router, self.replay_port, "replay")):
                try:
                    sock.bind(_endpoint(self.host, port))
                except zmq.ZMQError as e:
                    hint = ("the port is in use; choose another --kv-events-port (the replay socket "
                            "uses port + 1)") if e.errno == errno.EADDRINUSE else \
                        "check --kv-events-host names an address of this machine"
                    raise KVEventsBindError(
                        f"cannot bind the KV events {what} socket on {_endpoint(self.host, port)}: "
                        f"{e.strerror}; {hint}") from None
        except BaseException:
            pub.close(0)
            router.close(0)
            self._stop_zap()
            ctx.term()
            raise
        self._ctx, self._pub, self._router = ctx, pub, router

    def start(self, log: KVEventLog, model: str = "") -> None:
        """Start streaming ``log`` (binding first if needed). Records already in the ring are sent too.
        ``model``: the name clients use for the engine's model (the llm-d topic carries it); raises
        ``TopicError`` when the scheme cannot form a topic from it."""
        if self._threads:
            raise RuntimeError("KVEventPublisher.start() called twice")
        topic = self.scheme.topic(log.engine_id, model)
        self.bind()
        self.log = log
        self._topic = topic
        self._encoded = deque(maxlen=log.capacity)
        self._threads = [
            threading.Thread(target=self._stream_loop, name="kvmesh-kv-pub", daemon=True),
            threading.Thread(target=self._replay_loop, name="kvmesh-kv-replay", daemon=True),
        ]
        for t in self._threads:
            t.start()
        logger.info("KV events: publishing %s on %s (replay %s)", self.topic.decode(), self.endpoint,
                 self.replay_endpoint)

    def close(self, timeout: float = 5.0) -> None:
        """Stop both threads and release the ports (records not yet sent are not flushed)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self.log is not None:
            self.log.wake()
        for t in self._threads:
            t.join(timeout)
        if any(t.is_alive() for t in self._threads):
            logger.warning("KV event publisher threads did not stop within %.1fs", timeout)
            return  # sockets still in use: leave them to process exit rather than crash a thread
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(0)
        self._stop_zap()
        if self._ctx is not None:
            self._ctx.term()

    def _stop_zap(self) -> None:
        if self._zap is not None:
            self._zap.stop()  # type: ignore[attr-defined]
            self._zap = None

    def __enter__(self) -> KVEventPublisher:
        self.bind()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- threads --------------------------------------------------------------------------------
    def _stream_loop(self) -> None:
        assert self.log is not None and self._pub is not None
        ev_log, pub, topic = self.log, self._pub, self.topic
        last = 0
        try:
            while not self._stop.is_set():
                records = ev_log.wait_since(last, _WAIT_S)
                if records is None:
                    # The ring dropped records we never sent: skip them (subscribers resync).
                    oldest = ev_log.oldest_seq
                    self.stats.skipped += oldest - 1 - last
                    logger.warning("KV event stream fell behind; skipped records %d..%d", last + 1, oldest - 1)
                    last = oldest - 1
                    continue
                for rec in records:
                    seq, payload = encode_record(rec, self.token_ids)
                    with self._encoded_lock:
                        self._encoded.append((rec.seq, seq, payload))
                    try:
                        pub.send_multipart((topic, seq, payload), flags=zmq.NOBLOCK, copy=False)
                        self.stats.sent += 1
                    except zmq.Again:  # PUB does not block by design; counted as a gap for subscribers
                        pass
                    last = rec.seq
        except zmq.ZMQError as e:
            if not self._stop.is_set():
                logger.error("KV event stream stopped: %s", e)

    def _replay_loop(self) -> None:
        assert self.log is not None and self._router is not None
        router = self._router
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(_POLL_MS):
                    continue
                frames = router.recv_multipart()
                self._answer_replay(router, frames)
        except zmq.ZMQError as e:
            if not self._stop.is_set():
                logger.error("KV event replay socket stopped: %s", e)

    def _answer_replay(self, router: zmq.Socket, frames: list[bytes]) -> None:
        """Answer one request: ``[identity, seq]`` or vLLM's ``[identity, b"", seq]``."""
        assert self.log is not None
        identity = frames[0]
        self.stats.replay_requests += 1
        try:
            if len(frames) not in (2, 3) or (len(frames) == 3 and frames[1]):
                raise WireFormatError(f"a replay request has one seq frame, got {len(frames) - 1} frames")
            start = seq_from_bytes(frames[-1])
            # seq 0 names no record ("from the start"); one record past the cap tells an answer
            # the budget cut short from one that is complete.
            limit = self.budget.limits.max_records + 1
            records = self.log.since(max(start, 1) - 1, limit=limit)
            if records is None and start < self.log.oldest_seq:
                # The ring moved past ``start``: answer from its oldest record (as vLLM's publisher
                # does), so the asker sees the skip and resyncs instead of reading "nothing new".
                records = self.log.since(self.log.oldest_seq - 1, limit=limit)
            records = records or []
        except WireFormatError as e:
            logger.debug("bad KV replay request: %s", e)
            records = []
        granted = self.budget.grant(identity, len(records), time.monotonic())
        if granted < len(records):
            self.stats.replay_limited += 1
            records = records[:granted]
        try:
            for seq, payload in self._encoded_records(records):
                router.send_multipart((identity, b"", seq, payload), flags=zmq.NOBLOCK, copy=False)
                self.stats.replayed += 1
            router.send_multipart((identity, b"", REPLAY_END, b""), flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:  # EAGAIN: its queue is full; EHOSTUNREACH: it disconnected
            self.stats.replay_dropped += 1
            logger.debug("KV replay answer abandoned: %s", e)

    def _encoded_records(self, records: list[KVEventRecord]) -> list[tuple[bytes, bytes]]:
        """(seq frame, payload) of each record, from what the stream thread encoded where it can."""
        if not records:
            return []
        with self._encoded_lock:
            enc = self._encoded
            first = enc[0][0] if enc else 0
            out = []
            for rec in records:
                i = rec.seq - first
                # The deque holds consecutive seqs except where the stream thread skipped some.
                if enc and 0 <= i < len(enc) and enc[i][0] == rec.seq:
                    out.append(enc[i][1:])
                else:
                    out.append(None)
        return [got if got is not None else encode_record(rec, self.token_ids)
                for got, rec in zip(out, records)]
