"""RMSNorm: reference against HF LlamaRMSNorm, Triton against the reference."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from kvmesh.engine.kernels.rmsnorm import rms_norm_ref, rms_norm_triton

from ._helpers import ulp_tolerance


def _hf_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = LlamaRMSNorm(x.shape[-1], eps=eps)
    with torch.no_grad():
        norm.weight.copy_(weight)
        norm.weight.data = norm.weight.data.to(weight.dtype)
        return norm(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 576), (5, 9, 64)])
def test_ref_matches_hf_bitwise(dtype, shape):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    y, h = rms_norm_ref(x, w, 1e-5)
    assert h is None
    expected = _hf_norm(x, w, 1e-5)
    assert y.dtype == expected.dtype
    assert torch.equal(y, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ref_residual_returns_sum_in_input_dtype(dtype):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 96, generator=g).to(dtype)
    r = torch.randn(4, 96, generator=g).to(dtype)
    w = torch.randn(96, generator=g).to(dtype)
    y, h = rms_norm_ref(x, w, 1e-6, residual=r)
    assert h.dtype == dtype and torch.equal(h, x + r)
    assert torch.equal(y, _hf_norm(x + r, w, 1e-6))


def test_ref_promotes_like_hf_when_weight_is_fp32():
    x = torch.randn(3, 32).bfloat16()
    w = torch.rand(32)
    y, _ = rms_norm_ref(x, w, 1e-5)
    assert y.dtype == torch.float32
    assert torch.equal(y, _hf_norm(x, w, 1e-5))


def test_ref_rejects_mismatched_weight():
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm_ref(torch.randn(2, 8), torch.ones(9), 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(6, 576), (3, 4, 128), (1, 100)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_triton_matches_ref(dtype, shape, with_residual):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(shape, generator=g) * 2).to(dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    r = torch.randn(shape, generator=g).to(dtype) if with_residual else None
    y_ref, h_ref = rms_norm_ref(x, w, 1e-5, residual=r)
    y, h = rms_norm_triton(x, w, 1e-5, residual=r)
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
    torch.testing.assert_close(y, y_ref, **ulp_tolerance(dtype))
    if with_residual:
        torch.testing.assert_close(h, h_ref, **ulp_tolerance(dtype))
    else:
        assert h is None


def test_triton_on_noncontiguous_rows():
    base = torch.randn(6, 2, 64)
    x = base[:, 0]  # row stride 128, unit stride inside a row
    w = torch.rand(64) + 0.5
    torch.testing.assert_close(rms_norm_triton(x, w, 1e-5)[0], rms_norm_ref(x, w, 1e-5)[0])
