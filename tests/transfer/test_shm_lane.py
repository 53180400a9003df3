"""The same-host lane: its chunk plan, its files, and a real ucxx server and client that use it.

Real here: ucxx endpoints over TCP for the control messages, sealed memfds handed over a unix
socket in /dev/shm for the bytes, the cache node's handler and store. Faults are a peer that names
sockets it does not own, offers memory that could be cut, lies about a chunk, or dies mid-payload:
each costs that connection only.
"""

from __future__ import annotations

import asyncio
import os
import socket as socketlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.engine.cachenode.service import CacheNodeHandler
from kvmesh.engine.cachenode.store import BlockStore
from kvmesh.engine.transfer.channel import Channel
from kvmesh.engine.transfer import protocol, shm_lane
from kvmesh.engine.transfer.client import AsyncKVClient, KVClient
from kvmesh.engine.transfer.errors import PeerGone, ProtocolError, TransferError, TransferTimeout
from kvmesh.engine.transfer.header import BlockBatch
from kvmesh.engine.transfer.loop_thread import LoopThread
from kvmesh.engine.transfer.server import KVServer
from kvmesh.engine.transfer.shm_lane import ShmLane

from tests.support.kv_blocks import blocks, layout
from tests.support.kv_server import Node

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not os.path.isdir(shm_lane.SHM_DIR), reason="no /dev/shm on this machine")]

MiB = 1 << 20


def lane_files() -> set[str]:
    return {n for n in os.listdir(shm_lane.SHM_DIR) if n.startswith("kvmesh-kv-")}


@pytest.fixture
def own_lanes(monkeypatch):
    """The lane names this test's connections offer (/dev/shm is shared with the suite's other
    worker, whose lanes come and go meanwhile: only these must be gone)."""
    names: set[str] = set()
    real = shm_lane.listen

    def listen(name=None):  # noqa: ANN001, ANN202
        sock, got = real(name)
        names.add(got)
        return sock, got

    monkeypatch.setattr(shm_lane, "listen", listen)
    return names


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


# ---- the shared memory and its exchange -----------------------------------------------------------
def lane_pair(chunk: int = MiB) -> tuple[ShmLane, ShmLane, int]:
    """Two ends of one lane in this process: (writer side, reader side, a spare fd of the reader's input)."""
    a, nonce_a = shm_lane.create_memfd(shm_lane.SLOTS * chunk)
    b, nonce_b = shm_lane.create_memfd(shm_lane.SLOTS * chunk)
    a_seen_by_b, b_seen_by_a, spare = os.dup(a), os.dup(b), os.dup(a)
    shm_lane.check_peer_memfd(a_seen_by_b, nonce_a, shm_lane.SLOTS * chunk)
    shm_lane.check_peer_memfd(b_seen_by_a, nonce_b, shm_lane.SLOTS * chunk)
    bell_a, bell_b = socketlib.socketpair()
    return ShmLane.of(a, b_seen_by_a, chunk, bell_a), ShmLane.of(b, a_seen_by_b, chunk, bell_b), spare


def test_a_lane_moves_chunks_through_both_slots_and_its_memory_cannot_be_cut():
    w, r, spare = lane_pair()
    try:
        rng = np.random.default_rng(0)
        src = [rng.integers(0, 255, n, dtype=np.uint8) for n in (700_000, 900_000, 1_500_000)]
        dst = np.zeros(sum(a.nbytes for a in src), np.uint8)  # one buffer: the reader's views coalesce
        outs = np.split(dst, np.cumsum([a.nbytes for a in src])[:-1])
        for i, chunk in enumerate(shm_lane.plan([a.nbytes for a in src], MiB)):
            w.write(i, [src[k][s:e] for k, s, e in chunk])
            r.read(i, [outs[k][s:e] for k, s, e in chunk])
        assert all(np.array_equal(a, b) for a, b in zip(src, outs))
        # A hostile peer holding the memfd cannot shrink (or grow) it under the reader's mapping.
        for size in (MiB // 2, 0, 8 * MiB):
            with pytest.raises(PermissionError):
                os.ftruncate(spare, size)
        assert r.inp is not None and not r.inp.flags.writeable  # the peer's memory is mapped read-only
        with pytest.raises(ProtocolError, match="do not fit"):
            r.read(0, [np.empty(MiB + 1, np.uint8)])
    finally:
        os.close(spare)
        w.close()
        r.close()
    with pytest.raises(ProtocolError, match="closed"):
        w.write(0, [np.zeros(8, np.uint8)])


def test_the_doorbell_checks_each_signal_and_a_closed_end_fails_the_waiter_at_once():
    async def scenario():
        w, r, spare = lane_pair()
        os.close(spare)
        try:
            await w.ring(shm_lane.FRAME, 0, 123)
            await r.wait(shm_lane.FRAME, 0, 123)
            await w.ring(shm_lane.FRAME, 1, 5)
            with pytest.raises(ProtocolError, match="frame 2 of 5 bytes was due"):
                await r.wait(shm_lane.FRAME, 2, 5)  # out of order
            await w.ring(shm_lane.ACK, 0)
            with pytest.raises(ProtocolError, match="was due"):
                await r.wait(shm_lane.FRAME, 0, 5)  # the wrong kind
            waiter = asyncio.ensure_future(r.wait(shm_lane.ACK, 0))
            await asyncio.sleep(0.01)
            w.close()  # the peer goes away mid-wait
            with pytest.raises(PeerGone):
                await asyncio.wait_for(waiter, 2)
            waiter = asyncio.ensure_future(r.wait(shm_lane.ACK, 0))
            await asyncio.sleep(0.01)
            r.close()  # this side aborts while its own wait is pending
            with pytest.raises((PeerGone, ProtocolError)):
                await asyncio.wait_for(waiter, 2)
        finally:
            w.close()
            r.close()

    lt = LoopThread()
    try:
        lt.call(scenario(), 20)
    finally:
        lt.close()


@settings(max_examples=100, deadline=None)
@given(raw=st.binary(min_size=16, max_size=16), kind=st.sampled_from([shm_lane.FRAME, shm_lane.ACK]),
       index=st.integers(0, 3), nbytes=st.one_of(st.none(), st.integers(0, 1 << 20)))
def test_any_16_bytes_on_the_doorbell_are_the_due_signal_or_a_protocol_error(raw, kind, index, nbytes):
    async def scenario():
        w, r, spare = lane_pair()
        os.close(spare)
        try:
            w.bell.send(raw)  # whatever a peer may write
            k, i, n = shm_lane._BELL.unpack(raw)
            due = (k, i) == (kind, index) and (nbytes is None or n == nbytes)
            try:
                await r.wait(kind, index, nbytes)
                assert due
            except ProtocolError:
                assert not due
        finally:
            w.close()
            r.close()

    asyncio.run(scenario())


def test_control_messages_on_the_bell_are_framed_bounded_and_timed():
    async def scenario():
        w, r, spare = lane_pair()
        os.close(spare)
        try:
            await w.send_message(b"hello")
            assert await r.recv_message(64, 1.0) == b"hello"
            await w.ring(shm_lane.FRAME, 0, 5)
            with pytest.raises(ProtocolError, match="control message was due"):
                await r.recv_message(64, 1.0)
            await w.send_message(b"x" * 65)
            with pytest.raises(ProtocolError, match="65-byte control message"):
                await r.recv_message(64, 1.0)
        finally:
            w.close()
            r.close()
        w, r, spare = lane_pair()
        os.close(spare)
        try:
            w.bell.send(shm_lane._BELL.pack(shm_lane.MESSAGE, 0, 10) + b"half")  # and then nothing
            with pytest.raises(TransferTimeout):
                await r.recv_message(64, 0.2)
        finally:
            w.close()
            r.close()

    asyncio.run(scenario())


@settings(max_examples=100, deadline=None)
@given(raw=st.binary(min_size=0, max_size=48))
def test_any_bytes_on_the_bell_are_a_message_or_a_clean_error(raw):
    async def scenario():
        w, r, spare = lane_pair()
        os.close(spare)
        try:
            w.bell.send(raw)
            w.close()  # and the peer goes: a short record must end in PeerGone, not a hang
            try:
                body = await r.recv_message(32, 1.0)
            except (ProtocolError, PeerGone, TransferTimeout):
                return
            k, _, n = shm_lane._BELL.unpack(raw[:16])
            assert k == shm_lane.MESSAGE and 0 < n <= 32 and body == raw[16:16 + n]
        finally:
            r.close()

    asyncio.run(scenario())


def test_coalesce_merges_back_to_back_views_of_one_buffer_only():
    buf = np.arange(100, dtype=np.uint8)
    other = np.arange(10, dtype=np.uint8)
    views = [buf[0:10], buf[10:30], other, buf[30:40], buf[50:60], buf[60:70]]
    merged = shm_lane.coalesce(views)
    assert [m.nbytes for m in merged] == [30, 10, 10, 20]
    assert np.array_equal(np.concatenate(merged), np.concatenate(views))
    assert np.shares_memory(merged[0], buf) and merged[1] is other


@pytest.mark.parametrize("name", ["../../etc/passwd", "kvmesh-kv-xyz", "kvmesh-kv-" + "A" * 32, "", "x" * 300])
def test_only_kvmesh_lane_names_are_used(name):
    with pytest.raises(ProtocolError, match="not a kvmesh lane name"):
        shm_lane.socket_path(name)


def test_only_a_sealed_memfd_of_the_right_size_and_nonce_is_taken():
    fd, nonce = shm_lane.create_memfd(MiB)
    unsealed = os.memfd_create("x", os.MFD_CLOEXEC)
    os.ftruncate(unsealed, MiB)
    plain = os.open(os.path.join(shm_lane.SHM_DIR, f"kvmesh-test-{os.getpid()}"), os.O_RDWR | os.O_CREAT, 0o600)
    os.unlink(os.path.join(shm_lane.SHM_DIR, f"kvmesh-test-{os.getpid()}"))
    try:
        shm_lane.check_peer_memfd(fd, nonce, MiB)
        with pytest.raises(ProtocolError, match="another nonce"):
            shm_lane.check_peer_memfd(fd, bytes(shm_lane.NONCE_BYTES), MiB)
        with pytest.raises(ProtocolError, match="smaller than"):
            shm_lane.check_peer_memfd(fd, nonce, 2 * MiB)
        with pytest.raises(ProtocolError, match="not sealed"):
            shm_lane.check_peer_memfd(unsealed, nonce, MiB)
        with pytest.raises(ProtocolError, match="not a sealable memfd|not sealed"):
            shm_lane.check_peer_memfd(plain, nonce, 1)
    finally:
        for f in (fd, unsealed, plain):
            os.close(f)


def test_the_exchange_hands_memfds_both_ways_and_ignores_a_caller_without_the_nonce():
    async def scenario():
        mine, nonce = shm_lane.create_memfd(MiB)
        theirs, _ = shm_lane.create_memfd(MiB)
        listener, name = shm_lane.listen()
        exchange = asyncio.ensure_future(shm_lane.hand_over(listener, name, mine, nonce))
        # A stranger that found the name but does not know the nonce gets nothing.
        with socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM) as stranger:
            stranger.connect(shm_lane.socket_path(name))
            socketlib.send_fds(stranger, [b"guess"], [theirs])
            await asyncio.sleep(0.05)
            stranger.setblocking(False)
            try:
                data, fds, _, _ = socketlib.recv_fds(stranger, 8, 1)
            except BlockingIOError:
                data, fds = b"", []
            assert (data, fds) == (b"", [])  # closed on it without an fd (or nothing sent at all)
        there = await shm_lane.take_over(name, theirs, nonce)
        here = await asyncio.wait_for(exchange, 5)
        got_by_peer, got_here = os.dup(there.fd), os.dup(here.fd)
        there.close()
        here.close()
        assert name not in lane_files()  # the name is gone once its one connection was taken
        shm_lane.check_peer_memfd(got_by_peer, nonce, MiB)  # the peer holds this side's memfd
        assert os.fstat(got_here).st_ino == os.fstat(theirs).st_ino
        for f in (mine, theirs, got_by_peer, got_here):
            os.close(f)

    lt = LoopThread()
    try:
        lt.call(scenario(), 20)
    finally:
        lt.close()


# ---- over a real connection ----------------------------------------------------------------------
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


def test_put_and_get_through_the_lane_are_byte_exact_and_leave_no_files(loop, own_lanes):
    node = lane_node(loop)
    lay = layout("bfloat16", block_size=16, layers=8, heads=4, head_dim=64)  # 128 KiB a block
    blks, _ = blocks(lay, 40)  # 5 MiB: five 1-MiB chunks per direction
    try:
        with node.client() as c:
            assert c.put(blks).result(20) == [protocol.STORED] * 40
            assert c._client.lanes == 1 and node.server.lanes == 1
            assert own_lanes and not own_lanes & lane_files()  # unlinked once each side opened the other's
            got = c.get(lay, [b.block_hash for b in blks]).result(20)
            assert [g.header for g in got] == [b.header for b in blks]
            assert all(np.array_equal(g.data, b.data) for g, b in zip(got, blks))
            stats = c.stats().result(10)
            assert stats["puts"] == 40
    finally:
        node.close()
    assert node.server.lanes == 0 and not own_lanes & lane_files()
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


async def dropped(ch: Channel) -> None:
    """The server dropped ``ch``: its next receive fails with PeerGone."""
    try:
        with pytest.raises(PeerGone):
            await ch.recv()
    finally:
        ch.abort()


def hostile_then_honest(loop: LoopThread, node: Node, hostile, blks: list) -> None:  # noqa: ANN001
    """Run ``hostile()`` against ``node``; an honest client's put of ``blks`` must then succeed in
    full, with every reservation of the hostile connection given back."""
    try:
        _run(loop, hostile())
        with node.client() as honest:
            assert honest.put(blks).result(20) == [protocol.STORED] * len(blks)
            assert node.store.reserved_bytes == 0
    finally:
        node.close()
    node.store.check_integrity()


def test_an_offer_naming_a_socket_that_is_not_there_is_declined_and_the_connection_serves_on(loop):
    node = lane_node(loop)
    lay = layout(block_size=16, layers=4)
    blks, _ = blocks(lay, 3)

    async def scenario():
        c = AsyncKVClient("127.0.0.1", node.server.port, shm=False)
        ch = await c._connect()
        try:
            plain = "kvmesh-kv-" + "1" * 32  # a regular file under a lane's name: nothing listens there
            open(shm_lane.socket_path(plain), "wb").close()
            for name in ("../../etc/passwd", "kvmesh-kv-" + "0" * 32, plain):
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
            os.unlink(shm_lane.socket_path(plain))
            ch.abort()

    try:
        statuses, lane = _run(loop, scenario())
        assert statuses == [protocol.STORED] * 3 and lane is None
    finally:
        node.close()


def test_a_peer_that_offers_memory_it_could_cut_is_declined_and_its_connection_serves_on(loop):
    node = lane_node(loop)
    lay = layout(block_size=16, layers=4)
    blks, _ = blocks(lay, 3)

    async def hostile():
        c = AsyncKVClient("127.0.0.1", node.server.port, shm=False)
        ch = await c._connect()
        unsealed = os.memfd_create("kvmesh-kv", os.MFD_CLOEXEC)  # could be truncated under a mapping
        os.ftruncate(unsealed, shm_lane.SLOTS * MiB)
        nonce = os.urandom(shm_lane.NONCE_BYTES)
        os.pwrite(unsealed, nonce, 0)
        listener, name = shm_lane.listen()
        exchange = asyncio.ensure_future(shm_lane.hand_over(listener, name, unsealed, nonce))
        try:
            await ch.send(protocol.ShmOffer(name, nonce, MiB))
            reply = await ch.expect(protocol.ShmAccept, protocol.ShmDecline)
            assert isinstance(reply, protocol.ShmDecline) and "not sealed" in reply.reason, reply
            (await asyncio.wait_for(exchange, 5)).close()  # the server's memfd came; it is dropped
            await ch.send(protocol.PutOffer(BlockBatch.of([b.header for b in blks])))
            await ch.expect(protocol.PutWant)
            await ch.send_payloads([b.data for b in blks])
            return (await ch.expect(protocol.PutDone)).statuses, ch.lane
        finally:
            os.close(unsealed)
            ch.abort()

    try:
        statuses, lane = _run(loop, hostile())
        assert statuses == [protocol.STORED] * 3 and lane is None and node.server.lanes == 0
    finally:
        node.close()
    node.store.check_integrity()


def test_a_peer_that_lies_about_a_chunk_loses_its_connection_and_no_one_else_notices(loop):
    node = lane_node(loop)
    lay = layout("bfloat16", block_size=16, layers=8, heads=4, head_dim=64)
    blks, _ = blocks(lay, 12)

    async def hostile():
        ch = await open_put(node, blks, lane_chunk_bytes=MiB)
        assert ch.lane is not None
        ch.lane.write(0, [blks[0].data])
        await ch.lane.ring(shm_lane.FRAME, 0, MiB + 1)  # more than the chunk the plan says
        await dropped(ch)

    hostile_then_honest(loop, node, hostile, blks)


@pytest.mark.parametrize("garbage", [b"\xff\xfe", b"", b"x" * 100])
def test_garbage_on_a_lane_s_bell_costs_that_connection_only(loop, garbage):
    node = lane_node(loop)
    lay = layout(block_size=16, layers=4)
    blks, _ = blocks(lay, 3)

    async def hostile():
        c = AsyncKVClient("127.0.0.1", node.server.port, shm=True, lane_chunk_bytes=MiB)
        ch = await c._connect()
        assert ch.lane is not None
        if garbage:
            await ch.lane.send_message(garbage)  # undecodable, or not a message of the protocol
        else:
            ch.lane.bell.send(shm_lane._BELL.pack(shm_lane.ACK, 7, 0))  # a signal where a request is due
        await dropped(ch)

    hostile_then_honest(loop, node, hostile, blks)


def test_a_sender_that_dies_mid_payload_is_a_clean_error_within_the_deadline(loop):
    node = lane_node(loop)
    lay = layout("bfloat16", block_size=16, layers=8, heads=4, head_dim=64)
    blks, _ = blocks(lay, 24)

    async def dies():
        ch = await open_put(node, blks, lane_chunk_bytes=MiB)
        n = ch.lane.write(0, [b.data for b in blks[:8]])
        await ch.lane.ring(shm_lane.FRAME, 0, n)
        await ch.lane.wait(shm_lane.ACK, 0)
        ch.abort()  # gone after one of three chunks

    try:
        _run(loop, dies())
        with node.client() as c:
            assert c.lookup([b.block_hash for b in blks]).result(10) == 0  # nothing half-stored
            assert c.put(blks).result(20) == [protocol.STORED] * 24
    finally:
        node.close()
    node.store.check_integrity()


def test_the_lane_is_offered_only_after_the_token_is_proven(loop, own_lanes):
    store = BlockStore(1 << 26)
    server = KVServer(CacheNodeHandler(store), token=lambda: "s3cret", auth_timeout=2.0)
    loop.call(server.start(), 10)
    try:
        with KVClient("127.0.0.1", server.port, loop=loop, timeout=10, token=lambda: "s3cret") as ok:
            assert ok.stats().result(10)["blocks"] == 0 and ok._client.lanes == 1
        with KVClient("127.0.0.1", server.port, loop=loop, timeout=10, token=lambda: "wrong") as bad:
            with pytest.raises(TransferError):
                bad.stats().result(10)
        assert server.lanes == 0 and own_lanes and not own_lanes & lane_files()
    finally:
        loop.call(server.close(), 10)


def test_a_lane_this_side_cannot_open_fails_one_connection_and_is_not_offered_again(loop, monkeypatch):
    """The server took the lane but this side cannot use what it handed over: that connection
    fails once, and the client's next connection goes over UCX alone."""
    real = shm_lane.check_peer_memfd
    calls = []

    def second_call_fails(fd, nonce, min_size):  # the server checks first, then the client
        calls.append(fd)
        if len(calls) == 2:
            raise ProtocolError("not usable here")
        return real(fd, nonce, min_size)

    monkeypatch.setattr(shm_lane, "check_peer_memfd", second_call_fails)
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
