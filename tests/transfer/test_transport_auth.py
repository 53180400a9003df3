"""The token handshake of the KV transport (engine/transfer/auth.py) over real ucxx endpoints:
a cache-node server with the real handler and store, clients with the right, a wrong or no
token, and a raw peer that skips the proof. Real: ucxx, the protocol, the server and the client."""

from __future__ import annotations

import pytest

from kvmesh.engine.cachenode.service import CacheNodeHandler
from kvmesh.engine.cachenode.store import BlockStore
from kvmesh.engine.transfer import auth, protocol
from kvmesh.engine.transfer.channel import Channel
from kvmesh.engine.transfer.client import KVClient
from kvmesh.engine.transfer.errors import AuthFailed, TransferError
from kvmesh.engine.transfer.loop_thread import LoopThread
from kvmesh.engine.transfer.server import KVServer

from tests.support.kv_blocks import blocks, layout

pytestmark = pytest.mark.timeout(60)
TOKEN = "the-deployment-token"


def _server(loop: LoopThread, token: str | None) -> tuple[KVServer, BlockStore]:
    store = BlockStore(1 << 26)
    server = KVServer(CacheNodeHandler(store, payload_timeout=2.0), token=lambda: token, auth_timeout=2.0)
    loop.call(server.start(), 10)
    return server, store


def _client(loop: LoopThread, server: KVServer, token: str | None) -> KVClient:
    return KVClient("127.0.0.1", server.port, loop=loop, timeout=10, token=lambda: token)


def test_a_client_with_the_token_is_served(loop):
    server, store = _server(loop, TOKEN)
    c = _client(loop, server, TOKEN)
    try:
        lay = layout("float32")
        blks, _ = blocks(lay, 3)
        assert c.put(blks).result(10) == [protocol.STORED] * 3
        assert c.lookup([b.block_hash for b in blks]).result(10) == 3
        assert server.auth_failures == 0
    finally:
        c.close()
        loop.call(server.close(), 10)


@pytest.mark.parametrize("client_token, match", [
    (None, "needs the deployment's internal token"),
    ("another-token", "did not prove the internal token"),  # the server's proof fails first
])
def test_a_client_without_the_token_gets_nothing_and_stores_nothing(loop, client_token, match):
    server, store = _server(loop, TOKEN)
    c = _client(loop, server, client_token)
    try:
        blks, _ = blocks(layout("float32"), 2)
        with pytest.raises(AuthFailed, match=match):
            c.put(blks).result(10)
        assert store.num_blocks == 0
    finally:
        c.close()
        loop.call(server.close(), 10)


def test_a_client_holding_a_token_refuses_a_server_that_checks_none(loop):
    server, store = _server(loop, None)  # an impostor, or a peer left without --auth-token-file
    c = _client(loop, server, TOKEN)
    try:
        blks, _ = blocks(layout("float32"), 2)
        with pytest.raises(AuthFailed, match="does not check the internal token"):
            c.put(blks).result(10)
        assert store.num_blocks == 0
    finally:
        c.close()
        loop.call(server.close(), 10)


def _raw_session(loop: LoopThread, port: int, after_hello) -> protocol.Message:
    """A peer speaking the protocol by hand: Hello, then ``after_hello(ch, server_hello)``; returns
    what the server answers next."""
    import ucxx

    async def run() -> protocol.Message:
        ep = await ucxx.create_endpoint("127.0.0.1", port)
        ch = Channel(ep, "raw")
        try:
            mine = auth.nonce()
            await ch.send(protocol.Hello(protocol.PROTOCOL_VERSION, "client", mine))
            hello = await ch.expect(protocol.Hello)
            await after_hello(ch, mine, hello)
            return await ch.recv()
        finally:
            ch.abort()

    return loop.call(run(), 20)


def test_a_peer_that_skips_or_forges_the_proof_is_answered_unauthorized_and_counted(loop):
    server, store = _server(loop, TOKEN)
    try:
        async def skip(ch, mine, hello):
            await ch.send(protocol.Lookup([b"\x00" * 32]))

        async def forge(ch, mine, hello):
            await ch.send(protocol.Auth(auth.proof("guess", auth.CLIENT, hello.nonce, mine)))

        async def replay_server_proof(ch, mine, hello):  # reflecting the server's own proof back
            await ch.send(protocol.Auth(hello.proof))

        for i, attack in enumerate((skip, forge, replay_server_proof), 1):
            try:
                reply = _raw_session(loop, server.port, attack)
            except TransferError:
                reply = None  # closed before the answer could be read: refused all the same
            if reply is not None:
                assert isinstance(reply, protocol.ErrorReply) and reply.kind == protocol.ERR_UNAUTHORIZED
            assert server.auth_failures == i
        assert store.num_blocks == 0
    finally:
        loop.call(server.close(), 10)


def test_proofs_bind_both_nonces_and_the_direction():
    a, b = auth.nonce(), auth.nonce()
    p = auth.proof(TOKEN, auth.CLIENT, a, b)
    assert auth.valid(TOKEN, auth.CLIENT, a, b, p)
    assert not auth.valid(TOKEN, auth.SERVER, a, b, p)  # no reflection
    assert not auth.valid(TOKEN, auth.CLIENT, b, a, p)  # no swapped nonces
    assert not auth.valid("other", auth.CLIENT, a, b, p)
    assert not auth.valid(TOKEN, auth.CLIENT, b"", b, auth.proof(TOKEN, auth.CLIENT, b"", b))  # nonces required


@pytest.mark.parametrize("stall", ["silent", "half a hello", "half a request"])
def test_a_peer_that_stalls_mid_message_is_closed_and_costs_nothing(loop, stall):
    """Connections that never finish a message (no Hello, a length and no body, a request cut
    after its length) are closed after message_timeout, counted, and reserve nothing; a client
    with the token is served meanwhile and after."""
    import asyncio
    import time

    import numpy as np
    import ucxx

    store = BlockStore(1 << 26)
    server = KVServer(CacheNodeHandler(store), token=lambda: TOKEN, message_timeout=0.5)
    loop.call(server.start(), 10)

    async def stall_on_server() -> None:
        ep = await ucxx.create_endpoint("127.0.0.1", server.port)
        ch = Channel(ep, "stalling")
        if stall == "half a hello":
            await ep.send(np.array([64], np.uint64))  # a length; the body never comes
        elif stall == "half a request":
            mine = auth.nonce()
            await ch.send(protocol.Hello(protocol.PROTOCOL_VERSION, "client", mine))
            hello = await ch.expect(protocol.Hello)
            await ch.send(protocol.Auth(auth.proof(TOKEN, auth.CLIENT, hello.nonce, mine)))
            await ch.expect(protocol.AuthOk)
            await ep.send(np.array([128], np.uint64))
        await asyncio.sleep(3)  # hold the connection open, sending nothing more
        ch.abort()

    stalled = loop.submit(stall_on_server())
    c = _client(loop, server, TOKEN)
    try:
        blks, _ = blocks(layout("float32"), 2)
        assert c.put(blks).result(10) == [protocol.STORED] * 2  # the stalled peer holds nobody up
        deadline = time.monotonic() + 10
        while server.timeouts == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.timeouts == 1 and store.reserved_bytes == 0
        assert c.lookup([b.block_hash for b in blks]).result(10) == 2
        stalled.result(10)
    finally:
        c.close()
        loop.call(server.close(), 10)
