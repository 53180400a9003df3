"""The transport over real ucxx endpoints (one process: server and client on one loop thread).

Faults are injected by handlers that stop mid-exchange: the client must fail with a specific
exception within its deadline, drop the connection, and reconnect for the next request. These run
the network path (same-host lanes off); tests/transfer/test_shm_lane.py runs the lane's.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

from kvmesh.engine.cachenode.service import CacheNodeHandler
from kvmesh.engine.transfer import protocol, ucx_payloads
from kvmesh.engine.transfer.client import ClientBusy, KVClient
from kvmesh.engine.transfer.errors import ConnectFailed, HeaderMismatch, PeerGone, TransferTimeout

from tests.support.kv_blocks import blocks, layout
from tests.support.kv_server import Node

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=[False, True], ids=["ucx", "lane"])
def node(loop, request):
    """Tests that take ``node`` run on both paths: the same answers whichever road the bytes take."""
    n = Node(loop, shm=request.param)
    yield n
    n.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_round_trip_data_equal(node, dtype):
    lay = layout(dtype, block_size=16, layers=4)
    blks, sources = blocks(lay, 6)
    c = node.client(timeout=10)
    try:
        assert c.put(blks[:2]).result(10) == [protocol.STORED] * 2
        # Two-phase put: held blocks are not sent again.
        assert c.put(blks).result(10) == [protocol.EXISTS] * 2 + [protocol.STORED] * 4
        hashes = [b.block_hash for b in blks]
        assert c.lookup(hashes).result(10) == 6
        got = c.get(lay, hashes).result(10)
        assert [g.header for g in got] == [b.header for b in blks]
        for g, src in zip(got, sources):
            for name, t in src.items():
                assert torch.equal(g.tensor(name), t)
        stats = c.stats().result(10)
        assert stats["blocks"] == 6 and stats["puts"] == 6 and stats["put_duplicates"] == 2
    finally:
        c.close()
    node.store.check_integrity()


@pytest.mark.parametrize("shm", [False, True], ids=["ucx", "lane"])
def test_a_put_larger_than_the_nodes_per_put_share_is_stored_whole(loop, shm):
    """The node takes two blocks of an offer (--max-put) and answers no_room for the rest: the
    client offers those again once the first arrived, so a long prefix is written through whole
    (a 6,800-token prefix lost its last 37 blocks of every chunk before)."""
    lay = layout()
    blks, _ = blocks(lay, 7)
    n = Node(loop, shm=shm, max_put=2 * lay.nbytes)
    try:
        with n.client() as c:
            assert c.put(blks).result(10) == [protocol.STORED] * 7
            assert c.lookup([b.block_hash for b in blks]).result(10) == 7
        assert n.store.stats.puts == 7
    finally:
        n.close()
    # A node whose whole in-flight room is smaller than a block makes no progress: the client
    # answers no_room at once instead of offering forever.
    n = Node(loop, shm=shm, max_inflight=lay.nbytes - 1)
    try:
        with n.client() as c:
            assert c.put(blks[:3]).result(10) == [protocol.NO_ROOM] * 3
    finally:
        n.close()


def test_get_returns_longest_prefix_and_misses_are_not_errors(node):
    lay = layout()
    blks, _ = blocks(lay, 4)
    hashes = [b.block_hash for b in blks]
    with node.client() as c:
        assert c.lookup(hashes).result(10) == 0
        assert c.get(lay, hashes).result(10) == []
        c.put(blks[:2] + blks[3:]).result(10)
        assert c.lookup(hashes).result(10) == 2
        assert [g.block_hash for g in c.get(lay, hashes).result(10)] == hashes[:2]


def test_mismatched_layout_rejected_on_get_and_put(node):
    lay = layout()
    blks, _ = blocks(lay, 2)
    with node.client() as c:
        c.put(blks).result(10)
        other = layout(head_dim=16)
        # Same extra key and hashes, other geometry: never loaded.
        other = type(other)(extra_key=lay.extra_key, dtype=lay.dtype, block_size=lay.block_size,
                            num_layers=lay.num_layers, num_kv_heads=lay.num_kv_heads, head_dim=16,
                            buffers=other.buffers)
        with pytest.raises(HeaderMismatch) as e:
            c.get(other, [b.block_hash for b in blks]).result(10)
        assert e.value.field == "head_dim"
        from kvmesh.engine.transfer.buffers import KVBlock
        from kvmesh.engine.transfer.header import BlockHeader
        clash = KVBlock(BlockHeader(other, blks[0].block_hash, None), np.zeros(other.nbytes, np.uint8))
        with pytest.raises(HeaderMismatch) as e:
            c.put([clash]).result(10)
        assert e.value.field == "head_dim"
        # The connection survived the rejections: a peer's refusal leaves the stream where it should
        # be, so the client keeps the connection for other requests instead of dropping it.
        assert c.open_connections == 1
        assert c.lookup([b.block_hash for b in blks]).result(10) == 2
    assert node.store.stats.rejected_headers == 2
    node.store.check_integrity()


class StallBeforePayload:
    """Answers a get's header, then never sends the payload (a hung peer)."""

    def __init__(self, real: CacheNodeHandler) -> None:
        self.real = real

    async def handle(self, msg, ch):
        if isinstance(msg, protocol.Get):
            blks = self.real.store.get(msg.layout, msg.hashes)
            from kvmesh.engine.transfer.header import BlockBatch
            await ch.send(protocol.GetReply(BlockBatch(msg.layout, [b.header.block_hash for b in blks],
                                                       [b.header.parent_hash for b in blks])))
            await asyncio.sleep(3600)
        await self.real.handle(msg, ch)


class DropMidPayload(StallBeforePayload):
    """Answers a get's header, sends part of the payload, then drops the connection (a dead peer)."""

    async def handle(self, msg, ch):
        if isinstance(msg, protocol.Get):
            blks = self.real.store.get(msg.layout, msg.hashes)
            from kvmesh.engine.transfer.header import BlockBatch
            await ch.send(protocol.GetReply(BlockBatch(msg.layout, [b.header.block_hash for b in blks],
                                                       [b.header.parent_hash for b in blks])))
            await ch.send_payloads([blks[0].data])
            ch.abort()
            return
        await self.real.handle(msg, ch)


def test_hung_peer_times_out_and_connection_is_replaced(loop):
    node = Node(loop, wrap=StallBeforePayload)
    lay = layout()
    blks, _ = blocks(lay, 3)
    try:
        with node.client(timeout=1.0) as c:
            c.put(blks).result(10)
            t0 = time.monotonic()
            with pytest.raises(TransferTimeout):
                c.get(lay, [b.block_hash for b in blks]).result(10)
            assert time.monotonic() - t0 < 3
            assert c.open_connections == 0  # dropped, not pooled
            assert c.lookup([b.block_hash for b in blks]).result(10) == 3  # a fresh connection works
    finally:
        node.close()


def test_peer_dropping_mid_transfer_is_a_clean_error(loop, monkeypatch):
    lay = layout(block_size=16, layers=4)
    monkeypatch.setattr(ucx_payloads, "CHUNK_BYTES", lay.nbytes)  # block 0 is a whole message
    node = Node(loop, wrap=DropMidPayload)
    blks, _ = blocks(lay, 8)
    try:
        with node.client(timeout=10.0) as c:
            c.put(blks).result(10)
            t0 = time.monotonic()
            with pytest.raises((PeerGone, TransferTimeout)) as e:
                c.get(lay, [b.block_hash for b in blks]).result(15)
            assert isinstance(e.value, PeerGone), f"a dropped connection should be detected, got {e.value}"
            assert time.monotonic() - t0 < 5
            assert c.lookup([b.block_hash for b in blks]).result(10) == 8
    finally:
        node.close()
    assert node.server.open_connections == 0


def test_put_abandoned_mid_payload_gives_reservations_back(loop, monkeypatch):
    lay = layout()
    monkeypatch.setattr(ucx_payloads, "CHUNK_BYTES", lay.nbytes)  # block 0 is a whole message
    node = Node(loop)
    blks, _ = blocks(lay, 4)

    async def half_put():
        from kvmesh.engine.transfer.client import AsyncKVClient
        from kvmesh.engine.transfer.header import BlockBatch
        c = AsyncKVClient("127.0.0.1", node.server.port)
        ch = await c._connect()
        await ch.send(protocol.PutOffer(BlockBatch.of([b.header for b in blks])))
        await ch.expect(protocol.PutWant)
        await ch.send_payloads([blks[0].data])
        ch.abort()  # the client dies before sending the rest

    try:
        loop.call(half_put(), 10)
        deadline = time.monotonic() + 5
        while node.store.reserved_bytes and time.monotonic() < deadline:
            time.sleep(0.05)
        assert node.store.reserved_bytes == 0 and node.store.num_blocks == 0
        assert node.store.stats.put_aborted == 4
        node.store.check_integrity()
    finally:
        node.close()


def test_nothing_listening_is_connect_failed(loop):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with KVClient("127.0.0.1", port, loop=loop, connect_timeout=2.0, timeout=5.0) as c:
        t0 = time.monotonic()
        with pytest.raises((ConnectFailed, TransferTimeout)):
            c.lookup([b"x" * 32]).result(10)
        assert time.monotonic() - t0 < 6


def test_client_busy_is_immediate(loop):
    node = Node(loop, wrap=StallBeforePayload)
    lay = layout()
    blks, _ = blocks(lay, 1)
    try:
        with node.client(max_pending=1, timeout=1.0) as c:
            c.put(blks).result(10)
            stuck = c.get(lay, [blks[0].block_hash])  # pending until its deadline
            with pytest.raises(ClientBusy):
                c.lookup([blks[0].block_hash])
            with pytest.raises(TransferTimeout):
                stuck.result(10)
            assert c.lookup([blks[0].block_hash]).result(10) == 1
    finally:
        node.close()
