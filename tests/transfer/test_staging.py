"""The staging pool: buffers come back only when given back, fit their size, and stay bounded."""

from __future__ import annotations

import threading

import numpy as np

from kvmesh.engine.transfer.staging import StagingPool


def test_a_buffer_is_reused_only_after_it_was_given_back():
    pool = StagingPool(max_free_bytes=1 << 20)
    a = pool.take(1000)
    b = pool.take(1000)
    assert a.nbytes == b.nbytes == 1000 and not np.shares_memory(a, b)  # a is still in use
    pool.give(a)
    c = pool.take(900)
    assert c.nbytes == 900 and np.shares_memory(c, a) and pool.reused == 1
    assert not np.shares_memory(pool.take(900), a)  # c holds it now


def test_a_small_request_does_not_take_a_much_larger_buffer_and_free_bytes_are_bounded():
    pool = StagingPool(max_free_bytes=3000)
    big = pool.take(2500)
    pool.give(big)
    assert not np.shares_memory(pool.take(1000), big)  # more than twice the size: left for a big one
    for _ in range(5):
        pool.give(np.empty(1000, np.uint8))
    assert pool.free_bytes <= 3000
    pool.give(big[10:20])  # a view of a buffer already free: not added twice
    assert pool.free_bytes <= 3000


def test_foreign_memory_is_never_pooled():
    pool = StagingPool()
    raw = bytearray(4096)
    pool.give(np.frombuffer(raw, np.uint8))
    pool.give(np.zeros(64, np.float32))
    assert pool.free_bytes == 0


def test_threads_taking_and_giving_never_share_a_buffer():
    pool = StagingPool(max_free_bytes=64 << 10)
    held: dict[int, np.ndarray] = {}
    lock = threading.Lock()
    clashes, errors = [], []

    def work(seed: int) -> None:
        try:
            rng = np.random.default_rng(seed)
            for _ in range(300):
                buf = pool.take(int(rng.integers(512, 2048)))
                with lock:
                    if any(np.shares_memory(buf, h) for h in held.values()):
                        clashes.append(buf)
                    held[id(buf)] = buf
                buf[:] = seed  # in use
                with lock:
                    del held[id(buf)]
                pool.give(buf)
        except Exception as e:  # noqa: BLE001 - surfaced by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not clashes and pool.reused > 0


def test_warm_buffers_serve_every_size_down_to_the_smallest_within_the_budget():
    pool = StagingPool(max_free_bytes=1000)
    assert pool.warm(400, smallest=50) == 400 + 200 + 100 + 50
    for n in (400, 201, 150, 60, 26):  # each fits a warm buffer (at most twice its size)...
        pool.give(got := pool.take(n))
        assert got.base.nbytes in (400, 200, 100, 50)
    assert pool.reused == 5
    pool.take(24)  # ...below half the smallest, a fresh one
    assert pool.reused == 5
    # Bounded by the budget: a largest beyond half of it starts at half.
    assert StagingPool(max_free_bytes=500).warm(400, smallest=50) == 250 + 125 + 62
