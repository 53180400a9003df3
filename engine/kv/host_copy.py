"""Device -> host copies of gathered rows, shared by the host KV tier and the host checkpoint tier.

On CPU a copy is one ``index_copy_`` per tensor, done when ``save`` returns. On CUDA the rows were
gathered on the compute stream (ordered before the forward that reuses their device memory); the
copies into the tier's pinned memory run on a side stream, and the gathered tensors stay
referenced until their event completes. ``wait`` blocks until every copy so far is done: call it
before a slot written by a save may be read or written again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class HostCopier:
    def __init__(self, device: torch.device) -> None:
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._inflight: list[tuple[torch.cuda.Event, list[torch.Tensor]]] = []

    def save(self, host: Sequence[torch.Tensor], rows: Sequence[torch.Tensor], slots: torch.Tensor) -> None:
        """``host[k][slots[i]] = rows[k][i]`` for every tensor k and row i (``slots`` on the CPU)."""
        if self._stream is None:
            for dst, src in zip(host, rows):
                dst.index_copy_(0, slots, src)
            return
        rows = [r.contiguous() for r in rows]
        done = torch.cuda.Event()
        self._stream.wait_stream(torch.cuda.current_stream(rows[0].device))
        with torch.cuda.stream(self._stream):
            for i, slot in enumerate(slots.tolist()):
                for dst, src in zip(host, rows):
                    dst[slot].copy_(src[i], non_blocking=True)
            done.record(self._stream)
        self._inflight.append((done, rows))

    def wait(self) -> None:
        for done, _ in self._inflight:
            done.synchronize()
        self._inflight.clear()
