"""KV transfer listeners bind the address they are told (engine/transfer/listener.py, ucx_env.py).
Real: ucxx and UCX, the compiled listener extension, the server with the cache-node handler, an
authenticated client; what is bound is read from the kernel's socket tables."""

from __future__ import annotations

import socket

import pytest

from kvmesh.engine.cachenode.service import CacheNodeHandler
from kvmesh.engine.cachenode.store import BlockStore
from kvmesh.engine.transfer import listener, protocol, ucx_env
from kvmesh.engine.transfer.client import KVClient
from kvmesh.engine.transfer.listener import ListenerBindError
from kvmesh.engine.transfer.loop_thread import LoopThread
from kvmesh.engine.transfer.server import KVServer

from tests.support.kv_blocks import blocks, layout
from tests.support.listening import listening_sockets, outside_address

pytestmark = pytest.mark.timeout(120)
TOKEN = "bound-listener-token"


def _server(loop: LoopThread, host: str) -> KVServer:
    server = KVServer(CacheNodeHandler(BlockStore(1 << 26), payload_timeout=2.0), host=host, token=lambda: TOKEN)
    loop.call(server.start(), 60)  # the first start may build the extension
    return server


def test_a_server_told_loopback_listens_there_only_and_serves(loop):
    server = _server(loop, "127.0.0.1")
    c = KVClient("127.0.0.1", server.port, loop=loop, timeout=10, token=lambda: TOKEN)
    try:
        bound = {addr for addr, port in listening_sockets() if port == server.port}
        assert bound == {"127.0.0.1"}
        outside = outside_address()
        if outside is not None:  # nothing answers on the machine's other address
            with pytest.raises(ConnectionRefusedError), socket.create_connection((outside, server.port), timeout=5):
                pass
        blks, _ = blocks(layout("float32"), 2)
        assert c.put(blks).result(10) == [protocol.STORED] * 2
        assert c.lookup([b.block_hash for b in blks]).result(10) == 2
    finally:
        c.close()
        loop.call(server.close(), 10)


def test_a_wildcard_host_uses_ucxx_own_listener_on_every_interface(loop):
    server = _server(loop, "0.0.0.0")
    try:
        assert {addr for addr, port in listening_sockets() if port == server.port} <= {"0.0.0.0", "::"}
    finally:
        loop.call(server.close(), 10)


def test_an_address_of_another_machine_is_a_clear_error(loop):
    server = KVServer(CacheNodeHandler(BlockStore(1 << 20)), host="192.0.2.254", token=lambda: TOKEN)
    with pytest.raises(ListenerBindError, match="192.0.2.254.*address of this machine"):
        loop.call(server.start(), 60)


def test_a_missing_compiler_is_named_with_the_way_out(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.delitem(__import__("sys").modules, "kvmesh_ucx_listener", raising=False)
    with pytest.raises(ListenerBindError, match="no-such-compiler"):
        listener.load_extension(tmp_path)
    assert not listener.extension_path(tmp_path).exists()


def test_the_net_device_of_an_address():
    lo = ucx_env.net_device_of("127.0.0.1")
    assert lo is not None and ucx_env.net_device_of("127.0.0.9") == ucx_env.net_device_of("localhost") == lo
    for host in ("0.0.0.0", "::", "::1", "192.0.2.254", "example.invalid"):
        assert ucx_env.net_device_of(host) is None
    outside = outside_address()
    if outside is not None:
        assert ucx_env.net_device_of(outside) not in (None, ucx_env.net_device_of("127.0.0.1"))


@pytest.mark.parametrize("bind, peers, expect", [
    ("127.0.0.1", (), "lo"),
    ("127.0.0.1", ("127.0.0.5",), "lo"),
    ("127.0.0.1", ("192.0.2.254",), None),  # a configured peer elsewhere keeps every device
    ("0.0.0.0", (), None),
    (None, (), None),
])
def test_ucx_is_given_the_bound_device_only(bind, peers, expect):
    env: dict[str, str] = {}
    ucx_env.apply_ucx_defaults(bind, peers, env)
    assert env.get("UCX_NET_DEVICES") == (ucx_env.net_device_of("127.0.0.1") if expect == "lo" else None)
    assert env["UCX_TCP_CM_REUSEADDR"] == "y"


def test_an_explicit_ucx_net_devices_wins():
    env = {"UCX_NET_DEVICES": "all"}
    ucx_env.apply_ucx_defaults("127.0.0.1", (), env)
    assert env["UCX_NET_DEVICES"] == "all"
