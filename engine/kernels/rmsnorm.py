"""RMSNorm with an optional fused residual add.

Numerics follow Hugging Face ``LlamaRMSNorm`` exactly: the input is upcast to fp32,
``variance = mean(x**2)`` over the last dimension, ``x * rsqrt(variance + eps)`` is cast
back to the input dtype, and only then multiplied by ``weight`` (so the output dtype is
``torch.promote_types(x.dtype, weight.dtype)``, as in HF). With a residual, the sum
``h = x + residual`` is formed in ``x.dtype`` first and returned so the caller can carry it
to the next layer.
"""

from __future__ import annotations

import torch

from ._common import check_triton_launch, next_power_of_2, require_last_dim_contiguous


def _check_inputs(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must be [{x.shape[-1]}] to normalise x of shape {tuple(x.shape)}, "
                         f"got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Torch RMSNorm over the last dim of ``x`` ([T, hidden] or [T, H, D]).

    Returns ``(norm(x) * weight, None)`` or, with ``residual``, ``(norm(h) * weight, h)``
    where ``h = x + residual`` in ``x.dtype``.
    """
    _check_inputs(x, weight, residual)
    h = x if residual is None else x + residual.to(x.dtype)
    hf = h.float()
    variance = hf.pow(2).mean(-1, keepdim=True)
    y = weight * (hf * torch.rsqrt(variance + eps)).to(x.dtype)
    return y, (None if residual is None else h)


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton version of :func:`rms_norm_ref`: fused add + norm, one program per row."""
    _check_inputs(x, weight, residual)
    check_triton_launch(x, weight, *(() if residual is None else (residual,)))
    from ._rmsnorm_kernel import rms_norm_kernel

    n = x.shape[-1]
    # Rows are addressed with one stride, so fold leading dims; reshape copies only if needed.
    x2 = x.reshape(-1, n)
    require_last_dim_contiguous("x", x2)
    rows = x2.shape[0]
    out = torch.empty((rows, n), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if residual is not None:
        r2 = residual.to(x.dtype).reshape(-1, n)
        require_last_dim_contiguous("residual", r2)
        h = torch.empty_like(x2)
    else:
        r2, h = x2, x2  # placeholders: never read or written when HAS_RESIDUAL is False
    block = next_power_of_2(n)
    if rows:
        rms_norm_kernel[(rows,)](
            x2, r2, h, weight.contiguous(), out,
            x2.stride(0), r2.stride(0), h.stride(0), out.stride(0),
            n, float(eps),
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            # One row per program: spread a wide row over more warps to keep registers low.
            num_warps=min(16, max(1, block // 512)),
            # No fused multiply-adds: each product rounds as in the reference.
            enable_fp_fusion=False,
        )
    y = out.view(x.shape)
    return y, (None if residual is None else h.view(x.shape))
