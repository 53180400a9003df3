"""Map a large host tensor's pages ahead of use, off the step thread.

Pools are allocated empty, and the kernel maps a page at its first write: without this, each KV
block the engine fills for the first time pays its page faults inside a step. On a 2-core Xeon VM
that was 4-34 ms of a 508-token prefill chunk's 30 layers (more where the hypervisor has not yet
backed the memory), until every block had been written once, i.e. for most of a fresh server's
first gigabytes of traffic.

``MADV_POPULATE_WRITE`` (Linux 5.14) maps the pages writable without writing to them, so what a
page already holds is untouched: it may run on a background thread while the engine writes KV
into the same pool. It also commits the pool's memory when the server starts, so a pool larger
than the memory the container may use fails at start-up rather than under load.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import threading

import torch

log = logging.getLogger("kvmesh.engine")

MADV_POPULATE_WRITE = 23  # <linux/mman.h>; Python's mmap module names it only from 3.13 on


def page_span(t: torch.Tensor) -> tuple[int, int]:
    """(start, end) addresses of the whole pages inside ``t``'s storage (end <= start: none)."""
    page = mmap.PAGESIZE
    first = t.data_ptr()
    return -(-first // page) * page, (first + t.untyped_storage().nbytes()) // page * page


def populate(t: torch.Tensor) -> bool:
    """Map every whole page of ``t``'s memory (a CPU tensor) writable; contents are unchanged.

    Returns False where the kernel or the tensor does not allow it (not Linux >= 5.14, not a CPU
    tensor, under a page); the pages then fault in at first use as before.
    """
    if t.device.type != "cpu" or t.is_pinned():  # pinned memory is mapped at allocation
        return False
    start, end = page_span(t)
    if end <= start:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return False
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    if madvise(start, end - start, MADV_POPULATE_WRITE) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS):
            log.warning("could not map %d MiB of pool memory ahead of use: %s", (end - start) >> 20,
                        errno.errorcode.get(err, err))
        return False
    return True


def populate_in_background(t: torch.Tensor, what: str) -> threading.Thread:
    """Run `populate` on a daemon thread (ctypes drops the GIL for the call); returns the thread."""
    def work() -> None:
        if populate(t):
            log.debug("mapped the %s's %d MiB ahead of use", what, t.untyped_storage().nbytes() >> 20)

    thread = threading.Thread(target=work, name=f"populate-{what}", daemon=True)
    thread.start()
    return thread
