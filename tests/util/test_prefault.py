"""``populate``: a pool's pages are mapped before use and what they hold is untouched.

Real: the kernel's madvise and mincore on a real 64 MiB allocation; residency is read back from
the kernel, not from kvmesh.
"""

from __future__ import annotations

import mmap

import pytest
import torch

from kvmesh.engine.util.prefault import populate, populate_in_background
from tests.support.residency import resident_pages

_MIB = 1 << 20


def _fresh(nbytes: int) -> torch.Tensor:
    # An mmap of our own: a torch allocation may reuse pages a previous test already mapped.
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(m, dtype=torch.uint8)


def test_populate_maps_every_page_without_changing_contents():
    t = _fresh(64 * _MIB)
    pages = 64 * _MIB // mmap.PAGESIZE
    t[::4096 * 7] = 7  # some pages written before, the rest never touched
    before, _ = resident_pages(t)
    assert before < pages // 2
    if not populate(t):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    assert resident_pages(t) == (pages, pages)
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
