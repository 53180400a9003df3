"""``populate``: a pool's pages are mapped before use and what they hold is untouched.

Real: the kernel's madvise and mincore on a real 64 MiB allocation; residency is read back from
the kernel, not from kvmesh.
"""

from __future__ import annotations

import ctypes
import mmap

import pytest
import torch

from kvmesh.engine.util.prefault import populate, populate_in_background

_MIB = 1 << 20


def _resident_pages(t: torch.Tensor) -> int:
    """Pages of ``t``'s whole-page span the kernel has mapped (mincore)."""
    page = mmap.PAGESIZE
    start = -(-t.data_ptr() // page) * page
    end = (t.data_ptr() + t.untyped_storage().nbytes()) // page * page
    n = (end - start) // page
    vec = (ctypes.c_ubyte * n)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(start, end - start, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec)


def _fresh(nbytes: int) -> torch.Tensor:
    # An mmap of our own: a torch allocation may reuse pages a previous test already mapped.
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(m, dtype=torch.uint8)


def test_populate_maps_every_page_without_changing_contents():
    t = _fresh(64 * _MIB)
    pages = 64 * _MIB // mmap.PAGESIZE
    t[::4096 * 7] = 7  # some pages written before, the rest never touched
    before = _resident_pages(t)
    assert before < pages // 2
    if not populate(t):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    assert _resident_pages(t) == pages
    assert int(t[::4096 * 7].min()) == 7 and int(t.sum()) == 7 * t[::4096 * 7].numel()


def test_the_background_populate_leaves_concurrent_writes_in_place():
    t = _fresh(64 * _MIB).view(torch.int32)
    thread = populate_in_background(t, "test pool")
    t[: 1 << 20] = torch.arange(1 << 20, dtype=torch.int32)  # the engine writing KV meanwhile
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert torch.equal(t[: 1 << 20], torch.arange(1 << 20, dtype=torch.int32))
    assert int(t[1 << 20:].abs().sum()) == 0


def test_what_cannot_be_populated_is_left_alone():
    assert not populate(torch.empty(0))
    assert not populate(torch.empty(4))  # under a page: nothing whole to map
