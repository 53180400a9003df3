"""A block's bytes: one flat uint8 array holding its named buffers back to back (``BlockLayout`` order).

Zero-copy rules: ``as_bytes`` of a contiguous CPU torch tensor or numpy array is a view (bf16 goes
through ``Tensor.view(torch.uint8)``, since numpy has no bfloat16); ``KVBlock.buffers()`` and
``KVBlock.tensor()`` are views into ``data``. The only copy on the send path is
``KVBlock.from_buffers``, which gathers per-layer slices (not adjacent in a paged pool) into one
message; a caller that already holds a block as one flat array sends it as it is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .header import BlockHeader


def as_bytes(buf: Any) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous CPU tensor or array (no copy; raises if one is needed)."""
    if isinstance(buf, np.ndarray):
        arr = buf
    else:  # torch.Tensor, imported lazily: the cache node never needs torch
        import torch

        if not isinstance(buf, torch.Tensor):
            raise TypeError(f"a KV buffer must be a numpy array or a CPU torch tensor, got {type(buf).__name__}")
        if buf.device.type != "cpu":
            raise ValueError(f"KV buffers travel from host memory; got a tensor on {buf.device} "
                             "(copy it to a pinned host buffer first)")
        if not buf.is_contiguous():
            raise ValueError("KV buffer tensor is not contiguous; a zero-copy view needs contiguous memory")
        arr = buf.reshape(-1).view(torch.uint8).numpy()  # reshape of a contiguous tensor is a view
    if not arr.flags.c_contiguous:
        raise ValueError("KV buffer array is not C-contiguous; a zero-copy view needs contiguous memory")
    return arr.reshape(-1).view(np.uint8)


def _root(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def covering(views: Sequence[np.ndarray]) -> np.ndarray | None:
    """One uint8 view of the memory ``views`` (1-D uint8, in order) occupy when they lie back to
    back in one C-contiguous buffer; None otherwise. Writing into it writes into them."""
    if len(views) == 1:
        return views[0]
    root = _root(views[0])
    if not root.flags.c_contiguous or any(_root(v) is not root for v in views[1:]):
        return None
    start = addr = views[0].ctypes.data
    for v in views:
        if v.ctypes.data != addr:
            return None
        addr += v.nbytes
    offset = start - root.ctypes.data
    return root.reshape(-1).view(np.uint8)[offset:offset + addr - start]


@dataclass(frozen=True)
class KVBlock:
    """One block: its header and its payload (``data.nbytes == header.layout.nbytes``).

    A block handed to ``put`` is read by the transport until the returned future completes; the
    caller must not overwrite ``data`` before then.
    """

    header: BlockHeader
    data: np.ndarray

    def __post_init__(self) -> None:
        if self.data.dtype != np.uint8 or self.data.ndim != 1:
            raise ValueError("KVBlock.data must be a flat uint8 array (use as_bytes)")
        if self.data.nbytes != self.header.layout.nbytes:
            raise ValueError(f"KVBlock.data has {self.data.nbytes} bytes; the layout says "
                             f"{self.header.layout.nbytes}")

    @property
    def block_hash(self) -> bytes:
        return self.header.block_hash

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    @classmethod
    def from_buffers(cls, header: BlockHeader, buffers: Mapping[str, Any],
                     out: np.ndarray | None = None) -> KVBlock:
        """Gather named buffers into one payload (one copy), into ``out`` when given (e.g. pinned)."""
        layout = header.layout
        data = np.empty(layout.nbytes, np.uint8) if out is None else as_bytes(out)[:layout.nbytes]
        if data.nbytes != layout.nbytes:
            raise ValueError(f"staging buffer has {data.nbytes} bytes, the block needs {layout.nbytes}")
        missing = [b.name for b in layout.buffers if b.name not in buffers]
        if missing:
            raise KeyError(f"block buffers missing: {missing}")
        for name, start, end in layout.offsets():
            src = as_bytes(buffers[name])
            if src.nbytes != end - start:
                raise ValueError(f"buffer {name!r} has {src.nbytes} bytes; the layout says {end - start}")
            data[start:end] = src
        return cls(header, data)

    def buffers(self) -> dict[str, np.ndarray]:
        """Named uint8 views into ``data`` (no copies)."""
        return {name: self.data[start:end] for name, start, end in self.header.layout.offsets()}

    def buffer(self, name: str) -> np.ndarray:
        for n, start, end in self.header.layout.offsets():
            if n == name:
                return self.data[start:end]
        raise KeyError(f"block has no buffer {name!r}")

    def tensor(self, name: str, shape: tuple[int, ...] | None = None) -> Any:
        """A torch view of one buffer in the layout's dtype (default shape: block_size, heads, head_dim)."""
        import torch

        layout = self.header.layout
        t = torch.from_numpy(self.buffer(name)).view(getattr(torch, layout.dtype))
        return t.view(shape or (layout.block_size, layout.num_kv_heads, layout.head_dim))
