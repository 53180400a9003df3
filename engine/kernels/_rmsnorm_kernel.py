"""Triton kernel behind :func:`kvmesh.engine.kernels.rmsnorm.rms_norm_triton`.

Imported lazily: ``triton.jit`` decides between compiling and interpreting when this
module is first imported.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(
    x_ptr, r_ptr, h_ptr, w_ptr, out_ptr,
    stride_x, stride_r, stride_h, stride_out,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program normalises one row; the whole row fits in BLOCK (>= n_cols) lanes."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # The sum is rounded to the input dtype first, exactly like `x + residual` in torch.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(h_ptr + row * stride_h + cols, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / n_cols
    # IEEE sqrt and division (not the approximate defaults): the scale then rounds like
    # torch's rsqrt, so outputs match the reference to the last bit in most rows.
    inv_rms = tl.div_rn(1.0, tl.sqrt_rn(variance + eps))
    normed = (xf * inv_rms).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)
