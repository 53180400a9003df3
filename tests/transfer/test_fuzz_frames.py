"""Fuzzed frames against a real KV server (ucxx, the protocol, the cache node's handler and store,
the token handshake): arbitrary bytes, lengths of any size, truncated messages, wrong versions,
forged proofs and, after a real handshake, malformed or absurd requests. The server drops the
connection or answers an error, never crashes, holds no reservation afterwards, keeps its memory
bounded, and serves an honest client between every two attacks."""

from __future__ import annotations

import asyncio
import itertools
import time

import msgspec
import numpy as np
import pytest
import ucxx
from hypothesis import HealthCheck, example, given, settings, strategies as st

from kvmesh.engine.cachenode.service import CacheNodeHandler
from kvmesh.engine.cachenode.store import BlockStore
from kvmesh.engine.transfer import auth, protocol
from kvmesh.engine.transfer.channel import Channel
from kvmesh.engine.transfer.client import KVClient
from kvmesh.engine.transfer.errors import TransferError
from kvmesh.engine.transfer.loop_thread import LoopThread
from kvmesh.engine.transfer.server import KVServer

from tests.support.kv_blocks import blocks, layout

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # about 20 s of real connections
TOKEN = "fuzz-token"
SEEDS = itertools.count(1000)
LAY = layout("float32")
LAY_RAW = msgspec.msgpack.decode(msgspec.msgpack.encode(LAY))  # the real layout as plain msgpack values

U64 = st.integers(0, 2**64 - 1) | st.sampled_from([0, 1, 4096, 4097, 64 << 20, (64 << 20) + 1, 2**63])
BUFFER = st.tuples(st.text(max_size=4), st.integers(-2, 2**62)).map(list)  # [name, nbytes]
LAYOUT = st.fixed_dictionaries({
    "version": st.integers(-1, 3), "extra_key": st.binary(max_size=40), "dtype": st.sampled_from(["float32", "x"]),
    "block_size": st.integers(-1, 2**31), "num_layers": st.integers(-1, 2**20), "num_kv_heads": st.integers(-1, 64),
    "head_dim": st.integers(-1, 512), "buffers": st.lists(BUFFER, max_size=3)})
HASHES = st.lists(st.binary(max_size=40), max_size=5)
BATCH = st.fixed_dictionaries({"layout": LAYOUT | st.just(LAY_RAW), "hashes": HASHES,
                               "parents": st.lists(st.none() | st.binary(max_size=40), max_size=5)})
# Requests as the protocol frames them (tagged arrays, transfer/protocol.py), with fields of any shape.
REQUEST = st.one_of(
    st.tuples(st.just("put"), BATCH).map(list),
    st.tuples(st.just("get"), LAYOUT | st.just(LAY_RAW), HASHES).map(list),
    st.tuples(st.just("lookup"), HASHES).map(list),
    st.just(["stats"]),
    st.tuples(st.sampled_from(["reserve", "push", "hello", "auth", "nope", ""]), HASHES,
              st.integers(-2**63, 2**64 - 1)).map(list),
)
# One step of an attack: what goes on the wire next.
STEP = st.one_of(
    st.tuples(st.just("length"), U64),                       # a length header alone
    st.tuples(st.just("bytes"), st.binary(max_size=300)),    # a message body nobody announced
    st.tuples(st.just("framed"), st.binary(max_size=300)),   # length + arbitrary body
    st.tuples(st.just("hello"), st.integers(-1, 4), st.binary(max_size=40)),  # version, nonce
    st.tuples(st.just("auth"), st.booleans()),               # the real proof, or a forged one
    st.tuples(st.just("request"), REQUEST),                  # a msgpack request, maybe malformed
)


@pytest.fixture(scope="module")
def node():
    loop = LoopThread()
    store = BlockStore(1 << 24, max_inflight_bytes=1 << 22)
    server = KVServer(CacheNodeHandler(store, payload_timeout=0.5, max_put=1 << 21), token=lambda: TOKEN,
                      auth_timeout=0.5, message_timeout=0.5)
    loop.call(server.start(), 10)
    honest = KVClient("127.0.0.1", server.port, loop=loop, timeout=10, token=lambda: TOKEN)
    yield loop, server, store, honest
    honest.close()
    loop.call(server.close(), 10)
    loop.close()


async def _attack(port: int, steps: list) -> None:
    ep = await ucxx.create_endpoint("127.0.0.1", port)
    ch = Channel(ep, "fuzzer")
    mine, theirs = auth.nonce(), b""
    try:
        for step in steps:
            kind = step[0]
            if kind == "length":
                await ep.send(np.array([step[1]], np.uint64))
            elif kind == "bytes":
                await ep.send(np.frombuffer(step[1] or b"\0", np.uint8))
            elif kind == "framed":
                body = step[1] or b"\0"
                await ep.send(np.array([len(body)], np.uint64))
                await ep.send(np.frombuffer(body, np.uint8))
            elif kind == "hello":
                await ch.send(protocol.Hello(step[1], "client", step[2] or mine))
                reply = await asyncio.wait_for(ch.recv(), 2)
                theirs = getattr(reply, "nonce", b"")
            elif kind == "auth":
                proof = auth.proof(TOKEN if step[1] else "guess", auth.CLIENT, theirs, mine)
                await ch.send(protocol.Auth(proof))
            else:
                body = msgspec.msgpack.encode(step[1])
                await ep.send(np.array([len(body)], np.uint64))
                await ep.send(np.frombuffer(body, np.uint8))
        await asyncio.sleep(0.1)  # let the server read it all before the endpoint goes
    except (TransferError, ucxx.exceptions.UCXError, TimeoutError, ValueError, msgspec.MsgspecError):
        pass  # the server refused or hung up: what it should do
    finally:
        ch.abort()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(handshake=st.booleans(), steps=st.lists(st.one_of(STEP, st.tuples(st.just("request"), REQUEST)),
                                              min_size=1, max_size=6))
@example(handshake=False, steps=[("length", 64 << 20)])  # 64 MiB announced before any proof
@example(handshake=True, steps=[("request", ["put", {"layout": LAY_RAW, "hashes": [b"x" * 32, b"y" * 32],
                                                     "parents": [None, b"x" * 32]}]), ("length", 5)])
@example(handshake=True, steps=[("request", ["put", {"layout": dict(LAY_RAW, buffers=[["k", 2**62]]),
                                                     "hashes": [b"x" * 32], "parents": [None]}])])
def test_no_frame_sequence_harms_the_server(node, handshake, steps):
    loop, server, store, honest = node
    if handshake:  # half the attacks come from a peer holding the token, past the handshake
        steps = [("hello", protocol.PROTOCOL_VERSION, b""), ("auth", True), *steps]
    loop.call(asyncio.wait_for(_attack(server.port, steps), 10), 20)
    deadline = time.monotonic() + 10
    while (server.open_connections > 1 or store.reserved_bytes) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert store.reserved_bytes == 0  # whatever it offered, nothing stays reserved
    assert server.open_connections <= 1  # the fuzzer's connection is gone; the honest one may stay
    blks, _ = blocks(LAY, 2, seed=next(SEEDS) % 49 + 1)  # chain() repeats its tokens every 50 seeds
    assert set(honest.put(blks).result(10)) <= {protocol.STORED, protocol.EXISTS}
    assert honest.lookup([b.block_hash for b in blks]).result(10) == 2
    store.check_integrity()
