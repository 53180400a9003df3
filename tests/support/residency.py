"""How many of a tensor's pages the kernel has mapped, read back with mincore(2)."""

from __future__ import annotations

import ctypes
import mmap

import torch


def page_span(t: torch.Tensor) -> tuple[int, int]:
    """(first, end) addresses of the whole pages inside ``t``'s storage."""
    page = mmap.PAGESIZE
    start = -(-t.data_ptr() // page) * page
    return start, (t.data_ptr() + t.untyped_storage().nbytes()) // page * page


def resident_pages(t: torch.Tensor) -> tuple[int, int]:
    """(mapped, total) whole pages of ``t``'s storage."""
    start, end = page_span(t)
    n = (end - start) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * n)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    if libc.mincore(start, end - start, vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(b & 1 for b in vec), n
