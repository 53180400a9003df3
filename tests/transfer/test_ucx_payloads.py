"""Payloads coalesced into chunk messages (engine/transfer/ucx_payloads.py). Real: ucxx endpoints
over loopback TCP on both sides; ``covering`` is checked directly."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvmesh.engine.transfer import ucx_payloads
from kvmesh.engine.transfer.loop_thread import LoopThread
from kvmesh.engine.transfer.buffers import as_bytes, covering
from kvmesh.engine.transfer.ucx_payloads import Slots

pytestmark = pytest.mark.timeout(60)


def test_covering_is_the_one_view_back_to_back_pieces_make():
    buf = np.arange(100, dtype=np.uint8)
    whole = covering([buf[10:20], buf[20:25], buf[25:40]])
    assert whole is not None and whole.nbytes == 30
    whole[:] = 7  # writes land in the pieces' memory
    assert (buf[10:40] == 7).all() and buf[9] == 9 and buf[40] == 40
    other = np.zeros(10, np.uint8)
    assert covering([buf[0:10], buf[11:20]]) is None  # a gap
    assert covering([buf[10:20], buf[0:10]]) is None  # out of order
    assert covering([buf[0:10], other]) is None  # another buffer
    f32 = np.zeros((4, 8), np.float32)  # pieces of a typed tensor's bytes
    flat = as_bytes(f32)
    assert covering([flat[:64], flat[64:]]).nbytes == f32.nbytes


def _pair(loop: LoopThread, sender, receiver):
    """Runs ``sender(ep)`` on a client endpoint and ``receiver(ep)`` on the listener's."""
    import ucxx

    async def run():
        accepted: asyncio.Future = asyncio.get_running_loop().create_future()
        listener = ucxx.create_listener(lambda ep: accepted.set_result(ep))
        client = await ucxx.create_endpoint("127.0.0.1", listener.port)
        server = await asyncio.wait_for(accepted, 10)
        try:
            await asyncio.gather(sender(client), receiver(server))
        finally:
            client.abort()
            server.abort()
            listener.close()

    loop.call(run(), 30)


@pytest.mark.parametrize("scattered_side", ["sender", "receiver", "both", "neither"])
def test_bytes_arrive_in_order_whichever_side_is_scattered(loop, scattered_side):
    rng = np.random.default_rng(0)
    sizes = [700] * 20 + [333]  # blocks, then a state of another size; chunks cut across them
    total = sum(sizes)
    data = rng.integers(0, 256, total, dtype=np.uint8)

    def arrays(scattered: bool, src: np.ndarray | None) -> list[np.ndarray]:
        bounds = np.cumsum([0, *sizes])
        if scattered:  # separate arrays, like a cache node's stored blocks
            return [np.array(src[a:b]) if src is not None else np.zeros(b - a, np.uint8)
                    for a, b in zip(bounds, bounds[1:])]
        one = src.copy() if src is not None else np.zeros(total, np.uint8)
        return [one[a:b] for a, b in zip(bounds, bounds[1:])]  # views of one buffer

    src = arrays(scattered_side in ("sender", "both"), data)
    out = arrays(scattered_side in ("receiver", "both"), None)
    # 1,000-byte chunks: 15 messages, more than the copy slots, so slots are reused.
    send_slots, recv_slots = Slots(1000), Slots(1000)
    _pair(loop, lambda ep: ucx_payloads.send(ep, src, 1 << 20, send_slots),
          lambda ep: ucx_payloads.recv_into(ep, out, 1 << 20, recv_slots))
    assert np.array_equal(np.concatenate(out), data)
    # Slots are made as needed and never more than the pool's count.
    assert (recv_slots.allocated_bytes > 0) == (scattered_side in ("receiver", "both"))
    assert recv_slots.allocated_bytes <= ucx_payloads.COPY_SLOTS * 1000


def test_more_chunks_than_the_window_in_flight(loop):
    data = np.random.default_rng(1).integers(0, 256, 64 * 100, dtype=np.uint8)
    out = np.zeros_like(data)
    n = 64 * 100 // 100
    assert n > ucx_payloads.WINDOW
    _pair(loop, lambda ep: ucx_payloads.send(ep, [data], 1 << 20, Slots(100)),
          lambda ep: ucx_payloads.recv_into(ep, [out], 1 << 20, Slots(100)))
    assert np.array_equal(out, data)


def test_a_longer_message_than_planned_fails_the_receive(loop):
    from ucxx.exceptions import UCXError

    out = np.zeros(1000, np.uint8)

    async def too_long(ep):  # one message of 2,000 bytes where the plan expects 1,000 + 0
        await ep.send(np.ones(2000, np.uint8), tag=1 << 20)

    with pytest.raises(UCXError):
        _pair(loop, too_long, lambda ep: ucx_payloads.recv_into(ep, [out], 1 << 20, Slots(1000)))


def test_channels_sharing_a_small_pool_wait_for_slots_and_never_share_one(loop):
    """Three transfers both ways at once through two 2-slot pools (one per side, as a server's and
    a client's): each waits for slots the others give back; the bytes all arrive intact."""
    import ucxx

    rng = np.random.default_rng(2)
    sizes = [300] * 30
    sends = [[rng.integers(0, 256, n, dtype=np.uint8) for n in sizes] for _ in range(3)]
    outs = [[np.zeros(n, np.uint8) for n in sizes] for _ in range(3)]
    send_pool, recv_pool = Slots(1000, count=2), Slots(1000, count=2)

    async def run():
        accepted: asyncio.Queue = asyncio.Queue()
        listener = ucxx.create_listener(accepted.put_nowait)
        clients = [await ucxx.create_endpoint("127.0.0.1", listener.port) for _ in range(3)]
        servers = [await asyncio.wait_for(accepted.get(), 10) for _ in range(3)]
        try:
            # Endpoints pair up in connect order; each pair gets its own tag range to be sure.
            await asyncio.gather(*(ucx_payloads.send(c, sends[k], (k + 1) << 20, send_pool)
                                   for k, c in enumerate(clients)),
                                 *(ucx_payloads.recv_into(s, outs[k], (k + 1) << 20, recv_pool)
                                   for k, s in enumerate(servers)))
        finally:
            for ep in clients + servers:
                ep.abort()
            listener.close()

    loop.call(run(), 30)
    for k in range(3):
        assert all(np.array_equal(a, b) for a, b in zip(sends[k], outs[k]))
    assert send_pool.allocated_bytes == recv_pool.allocated_bytes == 2000
    assert sorted(send_pool._free) == sorted(recv_pool._free) == [0, 1]  # all given back
