"""Matrix multiplies for the model's projections, with prepacked weights on CPU.

On CPU, oneDNN runs bf16 GEMMs about 25% faster when the weight is reordered
once into its blocked layout instead of on every call (measured at M=64 and
M=2048 on the 2-core dev machines); in fp32 on one thread the packed projections
of a 4-sequence decode step take half of F.linear's BLAS time (bench/step_profile.py
--interference, docs/benchmarks.md). The packed path is an internal torch op,
so it is used only when it exists and reproduces F.linear on a probe in the
model's dtype; the fp32 parity tests hold it to transformers' tokens.

A weight that came block-quantized from a GGUF file (kernels/quant_rows.py) is multiplied
from those blocks when x has at most ``QUANT_MAX_ROWS[dtype]`` rows: a decode step streams
every weight once for a few rows, and 4.5 bits a weight stream several times faster than 32
(bench/qlinear.py). In bf16 the product runs on AMX tiles, so only where the CPU has them.
The blocks are used only if the native kernel dequantizes them to the loaded weight (fp32, or
bf16 rounded from it) bit for bit, checked once per weight.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from kvmesh.engine.kernels import quant_rows
from kvmesh.engine.kernels.quant_rows import QuantRows

LinearFn = Callable[[torch.Tensor], torch.Tensor]


_PACKED_DTYPES = {torch.bfloat16: 1e-2, torch.float32: 1e-5}  # dtype -> probe tolerance
QUANT_MAX_ROWS = {torch.float32: 16, torch.bfloat16: 32}
"""Rows up to which the block-quantized product beats oneDNN's GEMM on one core streaming every
weight of the default model (bench/qlinear.py: fp32 2-2.7x faster at 1-8 rows, 1.35x at 16; bf16
on tiles 1.5-1.7x up to 32 rows; its first, unpipelined version was 0.96-1.05x at 64 rows, where
the limit was set)."""


def _packed_ok(dtype: torch.dtype) -> bool:
    try:
        w = torch.randn(32, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
        x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
        pw = torch.ops.mkldnn._reorder_linear_weight(w, 64)
        got = torch.ops.mkldnn._linear_pointwise(x, pw, None, "none", [], "")
        tol = _PACKED_DTYPES[dtype]
        return torch.allclose(got.float(), F.linear(x, w).float(), atol=tol, rtol=tol)
    except (AttributeError, RuntimeError):
        return False


class LinearFactory:
    """Builds `x -> x @ W.T (+ b)` closures; decides once whether packing is usable."""

    def __init__(self, device: torch.device, dtype: torch.dtype, batch_hint: int = 64) -> None:
        self.batch_hint = batch_hint
        self.quantized_bytes = 0  # weights multiplied from blocks for small batches
        self._blocks_ok: dict[torch.dtype, bool] = {}
        self.pack = (device.type == "cpu" and dtype in _PACKED_DTYPES
                     and torch.backends.mkldnn.is_available() and _packed_ok(dtype))

    def __call__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 quant: QuantRows | None = None) -> LinearFn:
        """``quant``: the same weight block-quantized, used for small batches when exact."""
        if not self.pack:
            dense: LinearFn = lambda x: F.linear(x, weight, bias)  # noqa: E731
        else:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, self.batch_hint)
            op = torch.ops.mkldnn._linear_pointwise
            dense = lambda x: op(x, packed, bias, "none", [], "")  # noqa: E731
        if quant is None or not self.exact_blocks(weight, quant):
            return dense
        from_blocks = quant_rows.product(quant)
        if from_blocks is None:
            return dense
        max_rows = QUANT_MAX_ROWS[weight.dtype]

        def small_from_blocks(x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] <= max_rows:
                y = from_blocks(x)
                if y is not None:
                    return y if bias is None else y.add_(bias)
            return dense(x)

        self.quantized_bytes += quant.nbytes
        return small_from_blocks

    def exact_blocks(self, weight: torch.Tensor, quant: QuantRows) -> bool:
        """Whether ``quant`` can stand in for ``weight``: fp32 or bf16 on CPU, a native kernel that
        multiplies that dtype from blocks here, and the blocks dequantized by it to exactly
        ``weight`` (False without the kernel)."""
        if weight.dtype not in QUANT_MAX_ROWS or weight.device.type != "cpu" \
                or tuple(weight.shape) != (quant.rows, quant.cols) or not self.blocks_multiply(weight.dtype):
            return False
        w = quant_rows.dequantize(quant, weight.dtype)
        return w is not None and torch.equal(w, weight)

    def blocks_multiply(self, dtype: torch.dtype) -> bool:
        """Whether the native kernel multiplies ``dtype`` from blocks on this machine (bf16 needs
        AMX tiles and the permission to use them): one probe product, decided once per factory."""
        if dtype not in self._blocks_ok:
            q = QuantRows(quant_rows.KIND_Q8_0, torch.full((16, 1), 0.5), None,
                          torch.ones(16, 1, 32, dtype=torch.uint8))
            y = quant_rows.qlinear(torch.ones(1, 32, dtype=dtype), q)
            self._blocks_ok[dtype] = y is not None and torch.equal(y, torch.full((1, 16), 16.0, dtype=dtype))
        return self._blocks_ok[dtype]
