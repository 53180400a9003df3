"""Receive buffers reused across transfers, so a payload lands in memory that is already mapped.

A fresh buffer pays a page fault per 4 KiB page on its first write: on the 2-core VMs here that
ran at 1.7-2.2 GB/s, below what the same-host lane moves, so a 157 MB reload spent ~90 ms faulting
memory in before its bytes could land. A buffer handed back after its contents were used (the
scatter into the KV cache is done) is handed out again instead.

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
