"""A weight matrix kept in the block-quantized form a GGUF file stores it in (Q4_1 or Q8_0).

The model runs in fp32 or bf16 on weights gguf dequantizes once at load; a decode step, which
multiplies a few rows by every weight, spends its time streaming those weights from memory.
`QuantRows` keeps the file's blocks beside them so the native kernel (csrc/cpu_qlinear.c)
can stream 4.5 or 8.5 bits per weight instead of 32 or 16 and dequantize in registers, to the
same fp32 values (or those rounded to bf16, for the bf16 product on AMX tiles).

Invariant: row n of the matrix is ``scale[n, b] * q + minv[n, b]`` (Q4_1) or
``q * scale[n, b]`` (Q8_0) over blocks b of 32 columns, each product and sum rounded to fp32
as gguf's reference dequantizer rounds them, with ``q`` unpacked from ``qs[n, b]``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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


_DEQUANT = {torch.float32: "kvmesh_dequant_rows_f32", torch.bfloat16: "kvmesh_dequant_rows_bf16"}
_QLINEAR = {torch.float32: "kvmesh_qlinear_f32", torch.bfloat16: "kvmesh_qlinear_bf16_amx"}
MAX_ROWS = {torch.bfloat16: 64}
"""Rows of x a kernel takes at most, where it has a limit (bf16: four tile accumulators of 16 rows)."""


def dequantize(q: QuantRows, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """The ``[rows, cols]`` matrix in ``dtype`` (fp32, or bf16 rounded from it to nearest even),
    dequantized by the native kernel's own code (None without the native library, or for bf16
    without AMX-BF16: the only kernel that multiplies bf16 from blocks runs on its tiles)."""
    from kvmesh.engine.kernels.cpu_native import load_library

    lib = load_library()
    if lib is None or dtype not in _DEQUANT:
        return None
    out = torch.empty(q.rows, q.cols, dtype=dtype)
    minv = q.minv if q.minv is not None else q.scale
    rc = getattr(lib, _DEQUANT[dtype])(q.scale.data_ptr(), minv.data_ptr(), q.qs.data_ptr(), q.kind,
                                       out.data_ptr(), q.rows, q.cols)
    return out if rc == 0 else None


def qlinear(x: torch.Tensor, q: QuantRows) -> torch.Tensor | None:
    """``x @ W.T`` in x's dtype for fp32 or bf16 CPU ``x`` ``[M, cols]`` (unit column stride; bf16:
    M <= 64), or None when the native kernel cannot take it (the caller then uses its dense path)."""
    fn = product(q)
    return None if fn is None else fn(x)


def product(q: QuantRows) -> Callable[[torch.Tensor], torch.Tensor | None] | None:
    """``qlinear`` bound to ``q`` (None without the native library): the kernel and the blocks'
    addresses looked up once, since a decode step calls it for every weight of the model."""
    from kvmesh.engine.kernels.cpu_native import load_library

    lib = load_library()
    if lib is None:
        return None
    kernels = {dtype: getattr(lib, name) for dtype, name in _QLINEAR.items()}
    blocks = (q.scale.data_ptr(), (q.minv if q.minv is not None else q.scale).data_ptr(), q.qs.data_ptr())
    rows, cols = q.rows, q.cols

    def run(x: torch.Tensor) -> torch.Tensor | None:
        kernel = kernels.get(x.dtype)
        if kernel is None or x.dim() != 2 or x.device.type != "cpu" or x.shape[1] != cols or x.stride(1) != 1 \
                or x.shape[0] > MAX_ROWS.get(x.dtype, x.shape[0]):
            return None
        out = torch.empty(x.shape[0], rows, dtype=x.dtype)
        # q itself (not only its addresses) in the closure: it keeps the blocks' memory alive.
        rc = kernel(x.data_ptr(), x.stride(0), *blocks, q.kind, out.data_ptr(), rows, x.shape[0], rows, cols,
                    torch.get_num_threads())
        return out if rc == 0 else None

    return run
