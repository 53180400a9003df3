"""KV events behind the internal token (engine/kv/event_auth.py): a CURVE publisher (real ZeroMQ
PUB and replay sockets, a ZAP handler) serves a subscriber holding the token, gap replay
included, and sends nothing to one without it or with another deployment's."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq

from kvmesh.engine.kv.event_auth import curve_keys, secure_client
from kvmesh.engine.kv.event_subscriber import KVCacheMirror, KVEventSubscriber
from kvmesh.engine.kv.event_wire import seq_bytes

from tests.support.kv_events import published_log, publish_random
from tests.support.waits import until

TOKEN = "the-deployment-token"


@pytest.fixture
def stream():
    with published_log("engine-s", TOKEN) as s:
        yield s


def test_a_subscriber_with_the_token_follows_the_stream_and_its_replays(stream):
    log, pub, snap = stream
    publish_random(log, 50, seed=1)

    async def main():
        mirror = KVCacheMirror()
        sub = KVEventSubscriber(pub.endpoint, pub.replay_endpoint, snap.url, mirror.on_event, mirror.reset,
                                replay_timeout_s=2.0, retry_s=0.05, token=TOKEN,
                                drop=lambda seq: seq in (60, 61, 75))  # gaps only a replay closes
        task = asyncio.ensure_future(sub.run())
        try:
            await asyncio.wait_for(sub.synced.wait(), 10)
            await asyncio.sleep(0.3)
            publish_random(log, 50, seed=2)
            await until(lambda: sub.last_seq == log.latest_seq, what=f"seq {log.latest_seq}")
            assert mirror.same_contents(log.snapshot())
            assert sub.stats.replays >= 1 and sub.stats.resyncs == 1  # replayed over CURVE, no resync
        finally:
            await sub.stop()
            await task

    asyncio.run(main())


@pytest.mark.parametrize("keys", [None, "another-deployments-token"])
def test_a_subscriber_without_the_token_receives_nothing(stream, keys):
    log, pub, _ = stream
    ctx = zmq.Context()
    sub, dealer = ctx.socket(zmq.SUB), ctx.socket(zmq.DEALER)
    try:
        for s in (sub, dealer):
            if keys:
                secure_client(s, curve_keys(keys))
            s.setsockopt(zmq.RCVTIMEO, 1000)
            s.setsockopt(zmq.SNDTIMEO, 1000)
            s.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        dealer.connect(pub.replay_endpoint)
        time.sleep(0.3)
        publish_random(log, 20, seed=3)
        with pytest.raises(zmq.Again):
            sub.recv_multipart()
        try:
            dealer.send_multipart([b"", seq_bytes(1)])  # a replay request as the subscriber sends it
        except zmq.Again:
            pass  # the refused handshake already removed the only peer: nothing can even be queued
        else:
            with pytest.raises(zmq.Again):
                dealer.recv_multipart()
    finally:
        sub.close(0)
        dealer.close(0)
        ctx.term()
    assert pub.stats.replayed == 0
