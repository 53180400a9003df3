"""A weight matrix kept in the block-quantized form a GGUF file stores it in (Q4_1 or Q8_0).

The model runs in fp32 on weights gguf dequantizes once at load; a decode step, which
multiplies a few rows by every weight, spends its time streaming those weights from memory.
`QuantRows` keeps the file's blocks beside them so the native kernel (csrc/cpu_qlinear.c)
can stream 4.5 or 8.5 bits per weight instead of 32 and dequantize in registers, to the same
fp32 values.

Invariant: row n of the matrix is ``scale[n, b] * q + minv[n, b]`` (Q4_1) or
``q * scale[n, b]`` (Q8_0) over blocks b of 32 columns, each product and sum rounded to fp32
as gguf's reference dequantizer rounds them, with ``q`` unpacked from ``qs[n, b]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

KIND_Q4_1, KIND_Q8_0 = 0, 1
BLOCK = 32
_LAYOUT = {"Q4_1": (KIND_Q4_1, 20, 16), "Q8_0": (KIND_Q8_0, 34, 32)}  # gguf type -> kind, block bytes, quant bytes


@dataclass(frozen=True)
class QuantRows:
    """``rows`` x ``cols`` weights as blocks: ``scale`` and ``minv`` fp32 ``[rows, cols // 32]``
    (``minv`` is None for Q8_0), ``qs`` uint8 ``[rows, cols // 32, 16 or 32]``."""

    kind: int
    scale: torch.Tensor
    minv: torch.Tensor | None
    qs: torch.Tensor

    @property
    def rows(self) -> int:
        return int(self.qs.shape[0])

    @property
    def cols(self) -> int:
        return int(self.qs.shape[1]) * BLOCK

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.scale, self.minv, self.qs) if t is not None)

    @classmethod
    def from_gguf(cls, data: np.ndarray, type_name: str) -> QuantRows | None:
        """The blocks of a GGUF tensor's raw data (uint8 ``[rows, row bytes]``), or None for a
        type this form does not cover."""
        layout = _LAYOUT.get(type_name)
        if layout is None or data.dtype != np.uint8 or data.ndim != 2:
            return None
        kind, block_bytes, quant_bytes = layout
        rows, row_bytes = data.shape
        if row_bytes % block_bytes:
            return None
        blocks = np.ascontiguousarray(data).reshape(rows, row_bytes // block_bytes, block_bytes)
        scale = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
        minv = None
        if kind == KIND_Q4_1:
            minv = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
        qs = torch.from_numpy(blocks[..., block_bytes - quant_bytes:].copy())
        return cls(kind, scale, minv, qs)

    def take(self, index: torch.Tensor) -> QuantRows:
        """These rows in the order of ``index`` (a permutation or selection of row numbers)."""
        minv = None if self.minv is None else self.minv.index_select(0, index).contiguous()
        return QuantRows(self.kind, self.scale.index_select(0, index).contiguous(), minv,
                         self.qs.index_select(0, index).contiguous())

    @staticmethod
    def cat(parts: Sequence[QuantRows]) -> QuantRows | None:
        """The parts' rows stacked (as ``torch.cat`` of their matrices), or None when they
        are of different kinds or widths."""
        if not parts or any(p.kind != parts[0].kind or p.cols != parts[0].cols for p in parts):
            return None
        minv = None if parts[0].minv is None else torch.cat([p.minv for p in parts])  # type: ignore[misc]
        return QuantRows(parts[0].kind, torch.cat([p.scale for p in parts]), minv, torch.cat([p.qs for p in parts]))


def dequantize(q: QuantRows) -> torch.Tensor | None:
    """The fp32 ``[rows, cols]`` matrix, dequantized by the native kernel's own code (None
    without the native library or AVX512F)."""
    from kvmesh.engine.kernels.cpu_native import load_library

    lib = load_library()
    if lib is None:
        return None
    out = torch.empty(q.rows, q.cols, dtype=torch.float32)
    minv = q.minv if q.minv is not None else q.scale
    rc = lib.kvmesh_dequant_rows_f32(q.scale.data_ptr(), minv.data_ptr(), q.qs.data_ptr(), q.kind, out.data_ptr(),
                                     q.rows, q.cols)
    return out if rc == 0 else None


def qlinear(x: torch.Tensor, q: QuantRows) -> torch.Tensor | None:
    """``x @ W.T`` for fp32 CPU ``x`` ``[M, cols]`` (unit column stride), or None when the native
    kernel cannot take it (the caller then uses its dense path)."""
    from kvmesh.engine.kernels.cpu_native import load_library

    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[1] != q.cols \
            or x.stride(1) != 1:
        return None
    lib = load_library()
    if lib is None:
        return None
    out = torch.empty(x.shape[0], q.rows, dtype=torch.float32)
    minv = q.minv if q.minv is not None else q.scale
    rc = lib.kvmesh_qlinear_f32(x.data_ptr(), x.stride(0), q.scale.data_ptr(), minv.data_ptr(), q.qs.data_ptr(),
                                q.kind, out.data_ptr(), out.stride(0), x.shape[0], q.rows, q.cols,
                                torch.get_num_threads())
    return out if rc == 0 else None
