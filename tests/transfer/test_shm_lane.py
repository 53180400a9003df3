"""The same-host lane: its chunk plan, its files, and a real ucxx server and client that use it.

Real here: ucxx endpoints over TCP for the control messages, tmpfs files in /dev/shm for the
bytes, the cache node's handler and store. Faults are a peer that names files it does not own,
cuts its file after the lane is set up, or dies mid-payload: each costs that connection only.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.engine.cachenode.service import CacheNodeHandler
from kvmesh.engine.cachenode.store import BlockStore
from kvmesh.engine.transfer.channel import Channel
from kvmesh.engine.transfer import protocol, shm_lane
from kvmesh.engine.transfer.client import AsyncKVClient, KVClient
from kvmesh.engine.transfer.errors import PeerGone, ProtocolError, TransferError
from kvmesh.engine.transfer.header import BlockBatch
from kvmesh.engine.transfer.loop_thread import LoopThread
from kvmesh.engine.transfer.server import KVServer
from kvmesh.engine.transfer.shm_lane import LaneUnavailable, ShmLane

from tests.support.kv_blocks import blocks, layout
from tests.support.kv_server import Node

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not os.path.isdir(shm_lane.SHM_DIR), reason="no /dev/shm on this machine")]

MiB = 1 << 20


def lane_files() -> set[str]:
    return {n for n in os.listdir(shm_lane.SHM_DIR) if n.startswith("kvmesh-kv-")}


# ---- the plan ------------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 5000), max_size=20), chunk=st.integers(1, 3000))
def test_plan_covers_every_byte_once_in_order_within_chunks(sizes, chunk):
    chunks = shm_lane.plan(sizes, chunk)
    flat = [p for c in chunks for p in c]
    covered: dict[int, int] = {}
    for i, start, end in flat:
        assert start == covered.get(i, 0) and end > start  # contiguous, in order, no empty piece
        covered[i] = end
    assert covered == {i: s for i, s in enumerate(sizes) if s}
    assert all(0 < sum(e - s for _, s, e in c) <= chunk for c in chunks)
    assert all(sum(e - s for _, s, e in c) == chunk for c in chunks[:-1])  # only the last is short


# ---- the files -----------------------------------------------------------------------------------
def test_a_lane_moves_chunks_through_both_slots_and_refuses_a_cut_file():
    fd, name, nonce = shm_lane.create_lane_file(2 * MiB)
    peer = shm_lane.open_peer_file(name, nonce, 2 * MiB)
    assert name not in lane_files()  # the reader unlinked it: nothing is left behind on a crash
    w, r = ShmLane(fd, name, -1, MiB), ShmLane(-1, "kvmesh-kv-" + "0" * 32, peer, MiB)
    try:
        rng = np.random.default_rng(0)
        src = [rng.integers(0, 255, n, dtype=np.uint8) for n in (700_000, 900_000, 1_500_000)]
        dst = [np.zeros_like(a) for a in src]
        for i, chunk in enumerate(shm_lane.plan([a.nbytes for a in src], MiB)):
            w.write(i, [src[k][s:e] for k, s, e in chunk])
            r.read(i, [dst[k][s:e] for k, s, e in chunk])
        assert all(np.array_equal(a, b) for a, b in zip(src, dst))
        os.ftruncate(fd, MiB // 2)  # a hostile writer cuts the file under the reader
        with pytest.raises(ProtocolError, match="cut its file"):
            r.read(0, [np.empty(MiB, np.uint8)])
    finally:
        w.close()
        r.close()
    with pytest.raises(ProtocolError, match="closed"):
        w.write(0, [np.zeros(8, np.uint8)])


@pytest.mark.parametrize("name", ["../../etc/passwd", "kvmesh-kv-xyz", "kvmesh-kv-" + "A" * 32, "", "x" * 300])
def test_only_kvmesh_lane_names_are_opened(name):
    with pytest.raises(ProtocolError, match="not a kvmesh lane name"):
        shm_lane.open_peer_file(name, b"0" * shm_lane.NONCE_BYTES, 1)


def test_a_file_without_the_offered_nonce_or_of_the_wrong_size_is_refused():
    fd, name, nonce = shm_lane.create_lane_file(MiB)
    try:
        with pytest.raises(LaneUnavailable, match="another nonce"):
            shm_lane.open_peer_file(name, bytes(shm_lane.NONCE_BYTES), MiB)
        with pytest.raises(ProtocolError, match="file of this user"):
            shm_lane.open_peer_file(name, nonce, 2 * MiB)
        with pytest.raises(LaneUnavailable, match="not visible"):
            shm_lane.open_peer_file("kvmesh-kv-" + "0" * 32, nonce, MiB)
    finally:
        os.close(fd)
        os.unlink(os.path.join(shm_lane.SHM_DIR, name))


# ---- over a real connection ----------------------------------------------------------------------
@pytest.fixture
def loop():
    lt = LoopThread()
    yield lt
    lt.close()


def lane_node(loop: LoopThread, shm: bool = True) -> Node:
    # Small chunks: a put spans many, and both slots turn over.
    return Node(loop, shm=shm, client_defaults={"lane_chunk_bytes": MiB, "timeout": 20})


async def open_put(node: Node, blks: list, **kw) -> Channel:  # noqa: ANN003
    """A raw connection to ``node`` that has offered ``blks`` and been told which to send."""
    c = AsyncKVClient("127.0.0.1", node.server.port, **kw)
    ch = await c._connect()
    await ch.send(protocol.PutOffer(BlockBatch.of([b.header for b in blks])))
    await ch.expect(protocol.PutWant)
    return ch


def test_put_and_get_through_the_lane_are_byte_exact_and_leave_no_files(loop):
    before = lane_files()
    node = lane_node(loop)
    lay = layout("bfloat16", block_size=16, layers=8, heads=4, head_dim=64)  # 128 KiB a block
    blks, _ = blocks(lay, 40)  # 5 MiB: five 1-MiB chunks per direction
    try:
        with node.client() as c:
            assert c.put(blks).result(20) == [protocol.STORED] * 40
            assert c._client.lanes == 1 and node.server.lanes == 1
            assert lane_files() == before  # both names unlinked once each side opened the other's
            got = c.get(lay, [b.block_hash for b in blks]).result(20)
            assert [g.header for g in got] == [b.header for b in blks]
            assert all(np.array_equal(g.data, b.data) for g, b in zip(got, blks))
            stats = c.stats().result(10)
            assert stats["puts"] == 40
    finally:
        node.close()
    assert node.server.lanes == 0 and lane_files() == before
    node.store.check_integrity()


@pytest.mark.parametrize("server_shm, client_shm", [(False, True), (True, False)])
def test_either_side_without_lanes_keeps_the_network_path(loop, server_shm, client_shm):
    node = lane_node(loop, shm=server_shm)
    lay = layout(block_size=16, layers=4)
    blks, _ = blocks(lay, 6)
    try:
        with node.client(shm=client_shm) as c:
            assert c.put(blks).result(10) == [protocol.STORED] * 6
            got = c.get(lay, [b.block_hash for b in blks]).result(10)
            assert all(np.array_equal(g.data, b.data) for g, b in zip(got, blks))
            assert c._client.lanes == 0 and node.server.lanes == 0
    finally:
        node.close()


def _run(loop: LoopThread, coro):  # noqa: ANN001, ANN202
    return loop.call(coro, 30)


def test_an_offer_naming_a_file_it_does_not_own_is_declined_and_the_connection_serves_on(loop):
    node = lane_node(loop)
    lay = layout(block_size=16, layers=4)
    blks, _ = blocks(lay, 3)

    async def scenario():
        c = AsyncKVClient("127.0.0.1", node.server.port, shm=False)
        ch = await c._connect()
        try:
            for name in ("../../etc/passwd", "kvmesh-kv-" + "0" * 32):
                await ch.send(protocol.ShmOffer(name, bytes(16), MiB))
                reply = await ch.expect(protocol.ShmAccept, protocol.ShmDecline)
                assert isinstance(reply, protocol.ShmDecline), reply
            await ch.send(protocol.ShmOffer("kvmesh-kv-" + "0" * 32, bytes(16), 1 << 40))  # absurd chunk
            assert isinstance(await ch.expect(protocol.ShmAccept, protocol.ShmDecline), protocol.ShmDecline)
            await ch.send(protocol.PutOffer(BlockBatch.of([b.header for b in blks])))
            want = await ch.expect(protocol.PutWant)
            await ch.send_payloads([b.data for b, w in zip(blks, want.want) if w])
            done = await ch.expect(protocol.PutDone)
            return done.statuses, ch.lane
        finally:
            ch.abort()

    try:
        statuses, lane = _run(loop, scenario())
        assert statuses == [protocol.STORED] * 3 and lane is None
    finally:
        node.close()


def test_a_peer_that_cuts_its_lane_file_loses_its_connection_and_no_one_else_notices(loop):
    node = lane_node(loop)
    lay = layout("bfloat16", block_size=16, layers=8, heads=4, head_dim=64)
    blks, _ = blocks(lay, 12)

    async def hostile():
        ch = await open_put(node, blks, lane_chunk_bytes=MiB)
        assert ch.lane is not None
        try:
            ch.lane.write(0, [blks[0].data])
            os.ftruncate(ch.lane.out_fd, 4096)  # the server's read of chunk 0 now comes back short
            await ch.send(protocol.ShmFrame(0, MiB))
            with pytest.raises(PeerGone):
                await ch.recv()
        finally:
            ch.abort()

    try:
        _run(loop, hostile())
        with node.client() as honest:
            assert honest.put(blks).result(20) == [protocol.STORED] * 12
            assert node.store.reserved_bytes == 0  # the hostile put's reservations were given back
    finally:
        node.close()
    node.store.check_integrity()


def test_a_sender_that_dies_mid_payload_is_a_clean_error_within_the_deadline(loop):
    node = lane_node(loop)
    lay = layout("bfloat16", block_size=16, layers=8, heads=4, head_dim=64)
    blks, _ = blocks(lay, 24)

    async def dies():
        ch = await open_put(node, blks, lane_chunk_bytes=MiB)
        n = ch.lane.write(0, [b.data for b in blks[:8]])
        await ch.send(protocol.ShmFrame(0, n))
        await ch.expect(protocol.ShmAck)
        ch.abort()  # gone after one of three chunks

    try:
        _run(loop, dies())
        with node.client() as c:
            assert c.lookup([b.block_hash for b in blks]).result(10) == 0  # nothing half-stored
            assert c.put(blks).result(20) == [protocol.STORED] * 24
    finally:
        node.close()
    node.store.check_integrity()


def test_the_lane_is_offered_only_after_the_token_is_proven(loop):
    before = lane_files()
    store = BlockStore(1 << 26)
    server = KVServer(CacheNodeHandler(store), token=lambda: "s3cret", auth_timeout=2.0)
    loop.call(server.start(), 10)
    try:
        with KVClient("127.0.0.1", server.port, loop=loop, timeout=10, token=lambda: "s3cret") as ok:
            assert ok.stats().result(10)["blocks"] == 0 and ok._client.lanes == 1
        with KVClient("127.0.0.1", server.port, loop=loop, timeout=10, token=lambda: "wrong") as bad:
            with pytest.raises(TransferError):
                bad.stats().result(10)
        assert server.lanes == 0 and lane_files() == before
    finally:
        loop.call(server.close(), 10)


def test_a_lane_this_side_cannot_open_fails_one_connection_and_is_not_offered_again(loop, monkeypatch):
    """The server took the lane but its file is not visible here (an odd /dev/shm setup): that
    connection fails once, and the client's next connection goes over UCX alone."""
    real = shm_lane.open_peer_file
    calls = []

    def second_call_fails(name, nonce, min_size):  # the server opens first, then the client
        calls.append(name)
        if len(calls) == 2:
            raise LaneUnavailable("not visible here")
        return real(name, nonce, min_size)

    monkeypatch.setattr(shm_lane, "open_peer_file", second_call_fails)
    node = lane_node(loop)
    lay = layout(block_size=16, layers=4)
    blks, _ = blocks(lay, 4)
    try:
        with node.client() as c:
            with pytest.raises(PeerGone):
                c.put(blks).result(20)
            assert c.put(blks).result(20) == [protocol.STORED] * 4
            assert c._client.lanes == 0 and not c._client.shm
    finally:
        node.close()
    node.store.check_integrity()
