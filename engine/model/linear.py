"""Matrix multiplies for the model's projections, with prepacked weights on CPU.

On CPU, oneDNN runs bf16 GEMMs about 25% faster when the weight is reordered
once into its blocked layout instead of on every call (measured at M=64 and
M=2048 on the 2-core dev machines); in fp32 on one thread the packed projections
of a 4-sequence decode step take half of F.linear's BLAS time (bench/step_profile.py
--interference, docs/benchmarks.md). The packed path is an internal torch op,
so it is used only when it exists and reproduces F.linear on a probe in the
model's dtype; the fp32 parity tests hold it to transformers' tokens.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

LinearFn = Callable[[torch.Tensor], torch.Tensor]


_PACKED_DTYPES = {torch.bfloat16: 1e-2, torch.float32: 1e-5}  # dtype -> probe tolerance


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
        self.pack = (device.type == "cpu" and dtype in _PACKED_DTYPES
                     and torch.backends.mkldnn.is_available() and _packed_ok(dtype))

    def __call__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> LinearFn:
        if not self.pack:
            return lambda x: F.linear(x, weight, bias)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, self.batch_hint)
        op = torch.ops.mkldnn._linear_pointwise
        return lambda x: op(x, packed, bias, "none", [], "")
