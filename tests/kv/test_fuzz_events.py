"""Fuzzed KV event messages against the real subscriber: wrong frame counts, malformed seq
frames, seqs far ahead or going back, other engines' topics, undecodable or invalid payloads,
interleaved with the real stream of a real log. The subscriber never dies, never applies what
it cannot decode, and converges to the log (replays from the real publisher's replay socket,
resyncs from the snapshot).

Real: the subscriber, the mirror, the wire codec, the publisher's replay socket and the snapshot
route; the PUB socket the subscriber reads is the test's, so it can carry the malformed messages
between the real ones.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings, strategies as st

from kvmesh.engine.kv.event_publisher import KVEventPublisher
from kvmesh.engine.kv.event_subscriber import KVCacheMirror, KVEventSubscriber
from kvmesh.engine.kv.event_wire import encode_record, seq_bytes, topic_for
from kvmesh.engine.kv.events import KVEventLog
from kvmesh.engine.util.localproc import free_port, free_port_pair

from tests.support.kv_events import RandomCache, SnapshotServer
from tests.support.waits import until

pytestmark = pytest.mark.slow  # about 20 s: a subscriber per example

ENGINE = "engine-f"
BAD_MEDIUM = st.text(min_size=1, max_size=6).filter(lambda m: m.lower() not in ("gpu", "cpu", "remote"))
# Payloads that decode as msgpack but are not a valid batch (an invalid medium, wrong shapes).
EVENT = st.one_of(
    st.tuples(st.just("BlockStored"), st.lists(st.binary(max_size=33), max_size=2), st.none() | st.binary(max_size=4),
              st.lists(st.integers(0, 9), max_size=4), st.integers(-1, 64), st.none(), BAD_MEDIUM).map(list),
    st.tuples(st.just("BlockRemoved"), st.lists(st.binary(max_size=33), max_size=2), BAD_MEDIUM).map(list),
    st.tuples(st.sampled_from(["AllBlocksCleared", "Unknown", ""]), BAD_MEDIUM).map(list),
    # msgpack carries integers in [-2**63, 2**64): anything wider is unencodable, not malformed.
    st.lists(st.integers(-(2**63), 2**64 - 1) | st.text(max_size=3), max_size=3),
)
PAYLOAD = st.binary(max_size=80) | st.tuples(st.floats(allow_nan=False) | st.text(max_size=3),
                                             st.lists(EVENT, min_size=1, max_size=2)).map(
    lambda b: msgspec.msgpack.encode(list(b)))
SEQ = st.integers(-5, 10**7).map(lambda s: seq_bytes(s) if s >= 0 else s.to_bytes(8, "big", signed=True))
TOPIC = st.sampled_from([topic_for(ENGINE), topic_for("engine-other"), b"kv-events", b"", b"x" * 40])
MESSAGE = st.one_of(
    st.tuples(TOPIC, SEQ, PAYLOAD).map(list),
    st.tuples(TOPIC, st.binary(max_size=12), PAYLOAD).map(list),  # a seq frame of the wrong size
    st.lists(st.binary(max_size=16), max_size=5),  # any number of frames (PUB sends at least one)
).filter(lambda frames: len(frames) > 0)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(junk=st.lists(st.tuples(st.integers(0, 40), MESSAGE), max_size=8), seed=st.integers(0, 1000))
def test_malformed_messages_never_stop_the_subscriber_or_skew_its_mirror(junk, seed):
    log = KVEventLog(ENGINE, capacity=1_000)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = free_port()
    pub.bind(f"tcp://127.0.0.1:{port}")
    replay = KVEventPublisher("127.0.0.1", free_port_pair())  # its replay socket serves the real log

    def send_record(rec) -> None:
        seq, payload = encode_record(rec)
        pub.send_multipart([topic_for(ENGINE), seq, payload])

    async def main() -> None:
        mirror = KVCacheMirror()
        with SnapshotServer(log) as snap:
            sub = KVEventSubscriber(f"tcp://127.0.0.1:{port}", replay.replay_endpoint, snap.url, mirror.on_event,
                                    mirror.reset, replay_timeout_s=0.5, retry_s=0.05)
            task = asyncio.ensure_future(sub.run())
            try:
                await asyncio.wait_for(sub.synced.wait(), 10)
                await asyncio.sleep(0.2)  # PUB drops what it sends before the subscription is in
                cache = RandomCache(seed)
                by_step = dict()
                for at, frames in junk:
                    by_step.setdefault(at, []).append(frames)
                for step in range(41):
                    for frames in by_step.get(step, ()):
                        pub.send_multipart(frames)
                    send_record(log.publish(cache.next_event()))
                    await asyncio.sleep(0)
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline and not (
                        sub.last_seq == log.latest_seq and mirror.same_contents(log.snapshot())):
                    # A record may wait for a successor to reveal a gap: keep the stream moving.
                    send_record(log.publish(cache.next_event()))
                    await asyncio.sleep(0.05)
                assert not task.done(), task
                await until(lambda: sub.last_seq == log.latest_seq, what="the subscriber caught up", timeout=10)
                assert mirror.same_contents(log.snapshot())
            finally:
                await sub.stop()
                await task

    replay.start(log)
    try:
        asyncio.run(main())
    finally:
        replay.close()
        pub.close(0)
        ctx.term()
