"""How many of a tensor's pages the kernel has mapped, read back with mincore(2)."""

from __future__ import annotations

import ctypes
import mmap

import torch

from kvmesh.engine.util.prefault import page_span


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
