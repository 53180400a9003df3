"""Publisher and subscriber in one process over loopback ZeroMQ: ordering, gaps, replay, resync."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
import zmq

from kvmesh.engine.kv.event_publisher import KVEventPublisher, KVEventsBindError
from kvmesh.engine.kv.event_subscriber import KVCacheMirror, KVEventSubscriber, endpoints_from_info
from kvmesh.engine.kv.event_wire import REPLAY_END, KVEventBatch, decode_payload, seq_bytes, seq_from_bytes, topic_for
from kvmesh.engine.kv.events import BlockStored, KVEventLog
from kvmesh.engine.kv.replay_budget import ReplayLimits

from kvmesh.engine.util.localproc import free_port_pair

from tests.support.kv_events import SnapshotServer, published_log, publish_random
from tests.support.waits import until, wait_for


@contextlib.asynccontextmanager
async def following(pub: KVEventPublisher, snap: SnapshotServer, **kwargs) -> AsyncIterator[
        tuple[KVEventSubscriber, KVCacheMirror]]:
    mirror = KVCacheMirror()
    sub = KVEventSubscriber(pub.endpoint, pub.replay_endpoint, snap.url, mirror.on_event, mirror.reset,
                            replay_timeout_s=1.0, retry_s=0.05, **kwargs)
    task = asyncio.ensure_future(sub.run())
    try:
        await asyncio.wait_for(sub.synced.wait(), 10)
        yield sub, mirror
    finally:
        await sub.stop()
        await task


async def converged(log: KVEventLog, sub: KVEventSubscriber, mirror: KVCacheMirror) -> None:
    await until(lambda: sub.last_seq == log.latest_seq, what=f"seq {log.latest_seq}")
    assert mirror.seq == log.latest_seq
    assert mirror.same_contents(log.snapshot())


@pytest.fixture
def stream():
    with published_log("engine-a") as s:
        yield s


def test_subscriber_follows_the_stream(stream):
    log, pub, snap = stream

    async def main():
        async with following(pub, snap) as (sub, mirror):
            publish_random(log, 600, seed=1)
            await converged(log, sub, mirror)
            assert sub.stats.resyncs == 1 and sub.stats.gaps == 0
            assert sub.engine_id == "engine-a"

    asyncio.run(main())


def test_late_joiner_converges(stream):
    log, pub, snap = stream
    publish_random(log, 400, seed=2)

    async def main():
        async with following(pub, snap) as (sub, mirror):
            assert mirror.seq == 400  # the snapshot carried everything so far
            publish_random(log, 400, seed=3)
            await converged(log, sub, mirror)

    asyncio.run(main())


def test_dropped_messages_are_replayed(stream):
    log, pub, snap = stream

    async def main():
        async with following(pub, snap, drop=lambda seq: seq % 7 == 0) as (sub, mirror):
            publish_random(log, 500, seed=4)
            await until(lambda: sub.last_seq >= log.latest_seq - 1)  # the last one may wait for a successor
            log.publish(BlockStored([b"\x01" * 32], None, [1, 2, 3, 4], 4))
            await converged(log, sub, mirror)
            assert sub.stats.dropped > 0 and sub.stats.replays > 0 and sub.stats.replayed > 0
            assert sub.stats.resyncs == 1  # the replay buffer covered every gap

    asyncio.run(main())


def test_records_lost_at_the_end_of_a_burst_come_by_replay_once_the_stream_is_idle(stream):
    """The last records of a burst are lost and nothing follows to reveal the gap (a slow-joining
    SUB socket loses a whole burst the same way): the idle follower polls the replay socket."""
    log, pub, snap = stream

    async def main():
        async with following(pub, snap, drop=lambda seq: seq > 290, idle_poll_s=0.2) as (sub, mirror):
            publish_random(log, 300, seed=5)
            await converged(log, sub, mirror)
            assert sub.stats.dropped > 0 and sub.stats.tail_repairs >= 1 and sub.stats.resyncs == 1
            polls = sub.stats.idle_polls
            await until(lambda: sub.stats.idle_polls > polls)  # an idle poll finding nothing changes nothing
            await converged(log, sub, mirror)

    asyncio.run(main())


def test_a_tail_the_ring_no_longer_holds_resyncs_from_the_snapshot():
    log = KVEventLog("engine-t", capacity=20)

    async def main():
        with SnapshotServer(log) as snap, KVEventPublisher("127.0.0.1", free_port_pair()) as pub:
            pub.start(log)
            async with following(pub, snap, drop=lambda seq: seq > 10, idle_poll_s=0.2) as (sub, mirror):
                publish_random(log, 100, seed=6)
                await converged(log, sub, mirror)
                assert sub.stats.resyncs == 2 and sub.stats.tail_repairs == 0

    asyncio.run(main())


def test_gap_older_than_the_ring_resyncs_from_the_snapshot():
    log = KVEventLog("engine-b", capacity=20)
    pub = KVEventPublisher("127.0.0.1", free_port_pair())
    with SnapshotServer(log) as snap:
        pub.start(log)

        async def main():
            async with following(pub, snap, drop=lambda seq: 30 <= seq <= 120) as (sub, mirror):
                publish_random(log, 200, seed=5)
                await converged(log, sub, mirror)
                assert sub.stats.gaps >= 1 and sub.stats.resyncs >= 2

        try:
            asyncio.run(main())
        finally:
            pub.close()


def test_publisher_restart_resyncs():
    port = free_port_pair()
    log1 = KVEventLog("engine-1")
    with SnapshotServer(log1) as snap:
        pub1 = KVEventPublisher("127.0.0.1", port)
        pub1.start(log1)

        async def main():
            async with following(pub1, snap) as (sub, mirror):
                publish_random(log1, 300, seed=6)
                await converged(log1, sub, mirror)
                pub1.close()
                log2 = KVEventLog("engine-2")  # a new engine instance: seq restarts at 1
                snap.log = log2
                pub2 = KVEventPublisher("127.0.0.1", port)
                pub2.start(log2)
                try:
                    for _ in range(50):  # until the SUB socket has reconnected
                        publish_random(log2, 5, seed=len(log2.snapshot().hashes["gpu"]))
                        if sub.engine_id == "engine-2":
                            break
                        await asyncio.sleep(0.1)
                    await converged(log2, sub, mirror)
                    assert sub.stats.restarts >= 1 and mirror.engine_id == "engine-2"
                finally:
                    pub2.close()

        asyncio.run(main())


def test_seq_going_back_on_the_same_engine_id_resyncs(stream):
    log, pub, snap = stream

    async def main():
        async with following(pub, snap) as (sub, mirror):
            publish_random(log, 100, seed=7)
            await converged(log, sub, mirror)
            pub.close()
            log2 = KVEventLog("engine-a")
            snap.log = log2
            pub2 = KVEventPublisher("127.0.0.1", pub.port)
            pub2.start(log2)
            try:
                for i in range(50):
                    publish_random(log2, 3, seed=100 + i)
                    if sub.stats.restarts:
                        break
                    await asyncio.sleep(0.1)
                publish_random(log2, 3, seed=99)
                await converged(log2, sub, mirror)
            finally:
                pub2.close()

    asyncio.run(main())


# ---- the replay socket, raw ---------------------------------------------------------------------


def _replay(endpoint: str, frames: list[bytes]) -> list[int]:
    return [seq for seq, _ in _replay_batches(endpoint, frames)]


def _replay_batches(endpoint: str, frames: list[bytes]) -> list[tuple[int, KVEventBatch]]:
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart(frames)
        seqs = []
        while True:
            empty, raw, payload = dealer.recv_multipart()
            assert empty == b""
            if raw == REPLAY_END:
                assert payload == b""
                return seqs
            seqs.append((seq_from_bytes(raw), decode_payload(payload)))
    finally:
        dealer.close(0)
        ctx.term()


def test_replay_socket_answers():
    log = KVEventLog("engine-r", capacity=10)
    with KVEventPublisher("127.0.0.1", free_port_pair()) as pub:
        pub.start(log)
        publish_random(log, 25, seed=8)
        ep = pub.replay_endpoint
        assert _replay(ep, [seq_bytes(20)]) == [20, 21, 22, 23, 24, 25]
        assert _replay(ep, [b"", seq_bytes(16)]) == list(range(16, 26))  # vLLM framing
        assert _replay(ep, [seq_bytes(15)]) == list(range(16, 26))  # older than the ring: from its oldest
        assert _replay(ep, [seq_bytes(26)]) == []  # nothing newer
        assert _replay(ep, [seq_bytes(99)]) == []  # ahead of the log
        assert _replay(ep, [b"bad"]) == []  # malformed: still answered, never left hanging
        assert pub.topic == topic_for("engine-r")


def _subscriber(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    """A raw SUB socket on every KV event topic (5 s receive timeout)."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(endpoint)
    return sub


def test_pub_messages_are_topic_seq_payload():
    log = KVEventLog("engine-p")
    with KVEventPublisher("127.0.0.1", free_port_pair()) as pub:
        ctx = zmq.Context()
        sub = _subscriber(ctx, pub.endpoint)
        try:
            pub.start(log)
            time.sleep(0.3)  # PUB drops what it sends before the subscription arrives
            publish_random(log, 5, seed=9)
            got = [sub.recv_multipart() for _ in range(5)]
        finally:
            sub.close(0)
            ctx.term()
        assert [seq_from_bytes(s) for _, s, _ in got] == [1, 2, 3, 4, 5]
        assert {t for t, _, _ in got} == {b"kv-events/engine-p"}
        assert all(len(decode_payload(p).events) == 1 for _, _, p in got)
        # The publisher's thread counts a message after its send returns, which may be after the
        # subscriber has read it.
        wait_for(lambda: pub.stats.sent == 5, "the publisher to count its five sends", timeout=5)
        assert pub.stats.sent == 5


def test_bind_error_names_the_port_and_the_flag():
    port = free_port_pair()
    with KVEventPublisher("127.0.0.1", port):
        with pytest.raises(KVEventsBindError, match=rf"127\.0\.0\.1:{port}.*--kv-events-port"):
            KVEventPublisher("127.0.0.1", port).bind()
    with pytest.raises(ValueError, match="1..65534"):
        KVEventPublisher("127.0.0.1", 0)


def test_close_is_prompt_and_idempotent():
    log = KVEventLog("engine-c")
    pub = KVEventPublisher("127.0.0.1", free_port_pair())
    pub.start(log)
    t0 = time.monotonic()
    pub.close()
    pub.close()
    assert time.monotonic() - t0 < 0.5
    # The ports are free again.
    KVEventPublisher("127.0.0.1", pub.port).bind()


def test_endpoints_from_info():
    info = {"kv_events": {"port": 5557, "replay_port": 5558, "topic": "kv-events/e"}}
    ep = endpoints_from_info("http://10.1.2.3:8000/", info)
    assert (ep.pub, ep.replay, ep.snapshot_url) == ("tcp://10.1.2.3:5557", "tcp://10.1.2.3:5558",
                                                    "http://10.1.2.3:8000/kv/snapshot")
    assert endpoints_from_info("http://[::1]:8000", info).pub == "tcp://[::1]:5557"
    assert endpoints_from_info("http://h:8000", {"kv_events": None}) is None


# ---- a subscriber in another process ------------------------------------------------------------


class ChildSubscriber:
    def __init__(self, pub: KVEventPublisher, url: str, drop: str | None = None) -> None:
        import subprocess
        import sys
        from pathlib import Path

        script = Path(__file__).with_name("subscriber_child.py")
        argv = [sys.executable, str(script), pub.endpoint, pub.replay_endpoint, url] + ([drop] if drop else [])
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"

    def state_at(self, seq: int) -> dict:
        import json

        self.proc.stdin.write(f"{seq}\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except Exception:
            self.proc.kill()
            raise


def _same(state: dict, log: KVEventLog) -> bool:
    snap = log.snapshot()
    return state["seq"] == snap.seq and all(
        set(state["tiers"].get(t, [])) == {h.hex() for h in hs} for t, hs in snap.hashes.items())


@pytest.mark.parametrize("drop", [None, "%6", "40-150"], ids=["lossless", "replayed", "older-than-ring"])
def test_subscriber_in_another_process_converges(drop):
    # A 300-record burst can outrun the stream thread: only the ring case uses a ring that small.
    log = KVEventLog("engine-x", capacity=50 if drop == "40-150" else 1000)
    publish_random(log, 30, seed=10)  # the child is a late joiner
    with SnapshotServer(log) as snap, KVEventPublisher("127.0.0.1", free_port_pair()) as pub:
        pub.start(log)
        child = ChildSubscriber(pub, snap.url, drop)
        try:
            publish_random(log, 300, seed=11)
            state = child.state_at(log.latest_seq - 1)  # with "%6" the very last may be lost: add one
            log.publish(BlockStored([b"\x07" * 32], None, [1, 2, 3, 4], 4))
            state = child.state_at(log.latest_seq)
            assert _same(state, log)
            stats = state["stats"]
            if drop == "%6":
                assert stats["replays"] > 0 and stats["resyncs"] == 1
            elif drop == "40-150":
                assert stats["resyncs"] >= 2  # 110 lost records, a 50-record ring: only the snapshot helps
        finally:
            child.close()


def _first_stored(token_ids: bool) -> BlockStored:
    log = KVEventLog("engine-t")
    with KVEventPublisher("127.0.0.1", free_port_pair(), token_ids=token_ids) as pub:
        ctx = zmq.Context()
        sub = _subscriber(ctx, pub.endpoint)
        try:
            pub.start(log)
            time.sleep(0.3)  # PUB drops what it sends before the subscription arrives
            log.publish(BlockStored([b"\x01" * 32], None, [7, 8, 9, 10], 4))
            _, _, payload = sub.recv_multipart()
            ((seq, replayed),) = _replay_batches(pub.replay_endpoint, [seq_bytes(1)])
        finally:
            sub.close(0)
            ctx.term()
    (event,) = decode_payload(payload).events
    assert seq == 1 and replayed.events == [event]  # the replay socket says no more than PUB
    return event


def test_token_ids_stay_private_unless_asked_for():
    """Prompts never leave the engine on the event stream by default; hashes are enough to route."""
    assert _first_stored(token_ids=False).token_ids == []
    assert _first_stored(token_ids=True).token_ids == [7, 8, 9, 10]


def test_replay_answers_are_bounded_by_the_budget():
    log = KVEventLog("engine-b", capacity=100)
    limits = ReplayLimits(max_records=5, client_rate=1e-6, total_rate=1e9)
    with KVEventPublisher("127.0.0.1", free_port_pair(), replay_limits=limits) as pub:
        pub.start(log)
        publish_random(log, 25, seed=10)
        assert _replay(pub.replay_endpoint, [seq_bytes(1)]) == [1, 2, 3, 4, 5]  # cut short: resync
        assert pub.stats.replay_limited == 1
        assert _replay(pub.replay_endpoint, [seq_bytes(1)]) == [1, 2, 3, 4, 5]  # a new connection
        assert pub.stats.replayed == 10


def test_a_subscriber_that_never_reads_cannot_grow_the_engines_memory():
    """Replays to a DEALER that asks and never reads: the engine's queue for it stays bounded
    (answers are abandoned and counted) and other subscribers are still answered."""
    log = KVEventLog("engine-s", capacity=2_000)
    limits = ReplayLimits(max_records=1_000, client_rate=1e9, total_rate=1e9)
    with KVEventPublisher("127.0.0.1", free_port_pair(), replay_limits=limits) as pub:
        pub.start(log)
        publish_random(log, 1_000, seed=11)
        ctx = zmq.Context()
        hog = ctx.socket(zmq.DEALER)
        hog.setsockopt(zmq.RCVHWM, 1)
        hog.setsockopt(zmq.LINGER, 0)
        hog.connect(pub.replay_endpoint)
        try:
            for _ in range(400):
                hog.send_multipart([b"", seq_bytes(1)])
            until_sync = time.monotonic() + 60
            while pub.stats.replay_dropped == 0 and time.monotonic() < until_sync:
                time.sleep(0.05)
            assert pub.stats.replay_dropped > 0
            assert _replay(pub.replay_endpoint, [seq_bytes(990)]) == list(range(990, 1001))
        finally:
            hog.close(0)
            ctx.term()
