"""Receive buffers reused across transfers, so a payload lands in memory that is already mapped.

A fresh buffer pays a page fault per 4 KiB page on its first write: on the 2-core VMs here that
ran at 1.7-2.2 GB/s in a quiet process and several times slower in an engine whose transfer
threads were busy receiving, below what the same-host lane or UCX moves, so a process's first
157 MB reload took up to 4x as long as later ones (docs/benchmarks.md, "KV transfer"). A buffer
handed back after its contents were used (the scatter into the KV cache is done) is handed out
again instead, and ``warm`` faults buffers in ahead of need.

Invariants: a buffer is handed out by ``take`` only if it is fresh or its last user called
``give`` on it (the pool never guesses that a buffer is unused); free buffers hold at most
``max_free_bytes`` together; ``take(n)`` returns at least ``n`` bytes and never a free buffer more
than twice as large (a small payload does not pin a huge buffer). Thread-safe: the transfer loop
takes, the engine's step thread gives back.
"""

from __future__ import annotations

import threading

import numpy as np


class StagingPool:
    def __init__(self, max_free_bytes: int = 512 << 20) -> None:
        self.max_free_bytes = max_free_bytes
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()
        self.reused = 0
        """Buffers handed out again instead of allocated (a counter for tests and benchmarks)."""

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._free)

    def take(self, nbytes: int) -> np.ndarray:
        """A flat uint8 buffer of exactly ``nbytes`` (a view of a reused one, or a fresh one)."""
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if nbytes <= b.nbytes <= 2 * nbytes]
            if fits:
                buf = self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))
                self.reused += 1
                return buf[:nbytes]
        return np.empty(nbytes, np.uint8)

    def give(self, buf: np.ndarray) -> None:
        """Hand back a buffer from ``take`` (or any view of one) whose contents are no longer needed."""
        base = buf if buf.base is None else buf.base
        if not isinstance(base, np.ndarray) or base.dtype != np.uint8 or base.ndim != 1 or not base.flags.owndata:
            return  # not one of ours (e.g. a view of foreign memory): leave it to the collector
        with self._lock:
            if any(b is base for b in self._free):
                return
            self._free.append(base)
            # Keep the largest buffers: they serve every size up to themselves.
            self._free.sort(key=lambda b: b.nbytes, reverse=True)
            total = 0
            for i, b in enumerate(self._free):
                total += b.nbytes
                if total > self.max_free_bytes:
                    del self._free[i:]
                    break

    def warm(self, largest: int, smallest: int = 16 << 20) -> int:
        """Fault in free buffers now, so the first fetches land in mapped memory: sizes
        ``largest``, ``largest / 2``, ... down to ``smallest`` (each serves requests from half its
        size up, so together they serve every size in between), as many as ``max_free_bytes``
        holds; a ``largest`` beyond half of that starts at half of it (larger fetches fault as
        before). Returns the bytes made ready. Slow (page faults): call off the hot path."""
        sizes, total, size = [], 0, min(largest, self.max_free_bytes // 2)
        while size >= smallest and total + size <= self.max_free_bytes:
            sizes.append(size)
            total += size
            size //= 2
        for size in sizes:
            buf = np.empty(size, np.uint8)
            buf.fill(0)  # the write is what maps the pages (np.zeros would only reserve them)
            self.give(buf)
        return total
