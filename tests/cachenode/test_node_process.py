"""`kvmesh cache-node` as a real process: put/lookup/get from this process, HTTP side port, KV
events, a rejected header, a restart (misses, not errors) and a kill mid-transfer (a clean error)."""

from __future__ import annotations

import json
import signal
import time

import pytest
import torch
import zmq

from kvmesh.cli import build_parser
from kvmesh.engine.cachenode.cli import settings_from_args
from kvmesh.engine.kv.event_wire import decode_payload, seq_from_bytes, snapshot_from_json, to_internal
from kvmesh.engine.transfer import protocol
from kvmesh.engine.transfer.buffers import KVBlock
from kvmesh.engine.transfer.client import KVClient
from kvmesh.engine.transfer.errors import ConnectFailed, HeaderMismatch, PeerGone, TransferTimeout
from kvmesh.engine.transfer.header import BlockHeader
from kvmesh.engine.transfer.loop_thread import LoopThread

from ..support.listening import listening_sockets
from ..support.processes import NodeProc
from tests.support.kv_blocks import blocks, layout

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def loop():
    lt = LoopThread()
    yield lt
    lt.close()


def test_operator_command_line_parses(tmp_path):
    cfg = tmp_path / "kvmesh.yaml"
    cfg.write_text("cache:\n  memory: 8Gi\n")
    args = build_parser().parse_args(["cache-node", "--memory", "8Gi", "--host", "0.0.0.0", "--port", "8000",
                                      "--config", str(cfg)])
    s = settings_from_args(args)
    assert (s.memory, s.host, s.port, s.ucx_port) == (8 << 30, "0.0.0.0", 8000, 8001)
    args = build_parser().parse_args(["cache-node", "--config", str(cfg), "--ucx-port", "9000"])
    s = settings_from_args(args)
    assert (s.memory, s.ucx_port) == (8 << 30, 9000)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["cache-node", "--memory", "lots"])


def test_every_listener_binds_the_host_it_was_told(loop):
    """HTTP, UCX (its listener and its TCP transport's own) and ZMQ: nothing of a node told
    127.0.0.1 listens on another address; a client served there proves the UCX port is the node's."""
    node = NodeProc().start()
    try:
        sockets = listening_sockets(node.proc.pid)
        assert {node.http_port, node.ucx_port, node.events_port} <= {port for _, port in sockets}
        assert {addr for addr, _ in sockets} == {"127.0.0.1"}
        c = KVClient("127.0.0.1", node.ucx_port, loop=loop, timeout=10)
        try:
            blks, _ = blocks(layout(), 1)
            assert c.put(blks).result(10) == [protocol.STORED]
        finally:
            c.close()
    finally:
        node.stop()


def test_node_serves_blocks_http_and_events(loop):
    node = NodeProc().start()
    lay = layout(block_size=16, layers=4)
    blks, sources = blocks(lay, 8)
    hashes = [b.block_hash for b in blks]
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    sub.connect(f"tcp://127.0.0.1:{node.events_port}")
    try:
        time.sleep(0.3)  # let the SUB connect before the first event
        with KVClient("127.0.0.1", node.ucx_port, loop=loop, timeout=10) as c:
            assert c.lookup(hashes).result(15) == 0
            assert c.put(blks).result(15) == [protocol.STORED] * 8
            assert c.put(blks[:3]).result(15) == [protocol.EXISTS] * 3
            assert c.lookup(hashes).result(15) == 8
            got = c.get(lay, hashes).result(15)
            assert all(torch.equal(g.tensor(n), t) for g, src in zip(got, sources) for n, t in src.items())
            with pytest.raises(HeaderMismatch) as e:
                c.get(layout("float32", block_size=16, layers=4), hashes).result(15)
            assert e.value.field == "extra_key"
            stats = c.stats().result(15)
            assert stats["blocks"] == 8 and stats["rejected_headers"] == 1 and stats["node_id"] == "node-t"

        status, body = node.http("/metrics")
        text = body.decode()
        assert status == 200
        for name in ("kvmesh_cachenode_capacity_bytes 6.7108864e+07", "kvmesh_cachenode_blocks 8.0",
                     f"kvmesh_cachenode_used_bytes {8 * lay.nbytes}", "kvmesh_cachenode_puts_total 8.0",
                     "kvmesh_cachenode_hit_blocks_total 8.0", "kvmesh_cachenode_rejected_headers_total 1.0",
                     "kvmesh_cachenode_evictions_total 0.0",
                     f"kvmesh_cachenode_received_bytes_total {8 * lay.nbytes}",
                     f"kvmesh_cachenode_sent_bytes_total {8 * lay.nbytes}"):
            assert name in text, name
        info = json.loads(node.http("/kv/info")[1])
        assert info["ucx_port"] == node.ucx_port and info["tiers"] == ["remote"]
        assert info["kv_events"]["port"] == node.events_port
        snap = snapshot_from_json(json.loads(node.http("/kv/snapshot")[1]))
        assert snap.hashes["remote"] == frozenset(hashes) and snap.engine_id == "node-t"
        assert node.http("/health")[0] == 200 and node.http("/nope")[0] == 404

        seen = []
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        while len(seen) < 8 and poller.poll(5000):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv-events/node-t" and seq_from_bytes(seq) >= 1
            seen += [to_internal(ev) for ev in decode_payload(payload).events]
        assert [h for ev in seen for h in ev.block_hashes] == hashes
        assert {ev.tier for ev in seen} == {"remote"}
    finally:
        sub.close(0)
        ctx.term()
        assert node.stop() == 0


@pytest.mark.slow  # two node start-ups
def test_restart_means_misses_not_errors(loop):
    node = NodeProc(events=False).start()
    lay = layout()
    blks, _ = blocks(lay, 4)
    hashes = [b.block_hash for b in blks]
    try:
        with KVClient("127.0.0.1", node.ucx_port, loop=loop, timeout=10) as c:
            c.put(blks).result(15)
            assert c.lookup(hashes).result(15) == 4
            node.stop()
            node.start()  # same ports, empty store
            assert c.lookup(hashes).result(15) == 0
            assert c.get(lay, hashes).result(15) == []
            assert c.put(blks[:1]).result(15) == [protocol.STORED]
    finally:
        node.stop()


@pytest.mark.slow  # ~70 MB through the node
def test_killed_node_mid_get_is_a_clean_bounded_error(loop):
    node = NodeProc(memory="512MiB", events=False).start()
    lay = layout(block_size=16, layers=30, heads=3, head_dim=64)  # the default model's geometry
    blks, _ = blocks(lay, 8)
    many = []
    for i in range(24):  # 192 blocks, ~70 MB, re-using 8 payloads under distinct hashes
        for j, b in enumerate(blks):
            h = bytes([i, j]) + b.block_hash[2:]
            many.append(KVBlock(BlockHeader(lay, h, None), b.data))
    hashes = [b.block_hash for b in many]
    try:
        with KVClient("127.0.0.1", node.ucx_port, loop=loop, timeout=30) as c:
            stored = c.put(many).result(60).count(protocol.STORED)  # the node's --max-put takes 64 MiB of it
            assert stored > 100
            fut = c.get(lay, hashes)
            time.sleep(0.005)  # the get moves ~70 MB: on the same-host lane that takes some 20 ms
            node.stop(signal.SIGKILL)
            t0 = time.monotonic()
            try:
                got = fut.result(40)
                # It finished before the kill: still correct (the longest stored prefix).
                assert [g.block_hash for g in got] == hashes[:stored]
            except (PeerGone, TransferTimeout, ConnectFailed) as e:
                assert not isinstance(e, TransferTimeout), f"a killed peer should be seen before the deadline: {e}"
            assert time.monotonic() - t0 < 10
            with pytest.raises((ConnectFailed, PeerGone)):
                c.lookup(hashes).result(40)
            assert c.open_connections == 0
    finally:
        node.stop()


def test_a_batch_larger_than_the_lane_moves_exactly_between_processes(loop):
    """Real process on the far side of the same-host lane: a 40 MB put and get spans three 16 MiB
    chunks, so both slots turn over while the node reads one and this side writes the next."""
    node = NodeProc().start()
    lay = layout("bfloat16", block_size=16, layers=30, heads=3, head_dim=64)  # the default model's block
    blks, _ = blocks(lay, 110)
    hashes = [b.block_hash for b in blks]
    try:
        with KVClient("127.0.0.1", node.ucx_port, loop=loop, timeout=30) as c:
            assert c.put(blks).result(60) == [protocol.STORED] * 110
            assert c._client.lanes == 1, "a node on this host should have taken the lane"
            got = c.get(lay, hashes).result(60)
            assert [g.header for g in got] == [b.header for b in blks]
            assert all(torch.equal(torch.from_numpy(g.data), torch.from_numpy(b.data)) for g, b in zip(got, blks))
    finally:
        node.stop()
