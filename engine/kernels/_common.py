"""Helpers shared by the kernel modules: Triton availability, launch checks, cache views.

Triton is imported lazily (inside functions) so that the torch reference path runs on
machines without Triton, and so that ``TRITON_INTERPRET`` is read when a kernel module
is first used rather than when ``kvmesh.engine.kernels`` is imported.
"""

from __future__ import annotations

import os

import torch


class TritonUnavailableError(RuntimeError):
    """A ``*_triton`` function was called where Triton cannot run it."""


def triton_installed() -> bool:
    """True when the ``triton`` package can be imported."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_interpreting() -> bool:
    """True when Triton kernels run under the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def triton_usable(device: torch.device | str) -> bool:
    """Whether the ``*_triton`` functions can run on tensors living on ``device``."""
    if not triton_installed():
        return False
    return torch.device(device).type == "cuda" or triton_interpreting()


def check_triton_launch(*tensors: torch.Tensor) -> None:
    """Raise :class:`TritonUnavailableError` unless Triton can run on these tensors.

    All tensors must share one device; CPU tensors are accepted only under the interpreter.
    """
    if not triton_installed():
        raise TritonUnavailableError(
            "the triton package is not installed; use the *_ref functions (torch path) instead"
        )
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all kernel inputs must be on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type != "cuda" and not triton_interpreting():
        raise TritonUnavailableError(
            f"Triton kernels need CUDA tensors, got tensors on {device}; use the *_ref functions "
            "on CPU, or set TRITON_INTERPRET=1 before the first kernel call to run the interpreter"
        )


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    if n < 1:
        raise ValueError(f"next_power_of_2 needs n >= 1, got {n}")
    return 1 << (n - 1).bit_length()


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate a per-layer cache pair and return (num_blocks, block_size, num_kv_heads, head_dim)."""
    if k_cache.dim() != 4:
        raise ValueError(
            "k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache dtype {v_cache.dtype} != k_cache dtype {k_cache.dtype}")
    nb, bs, hkv, d = k_cache.shape
    return nb, bs, hkv, d


def check_gqa(num_q_heads: int, num_kv_heads: int) -> int:
    """Return the group size G = Hq / Hkv, raising if Hq is not a multiple of Hkv."""
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"number of query heads ({num_q_heads}) must be a positive multiple of "
            f"the number of kv heads ({num_kv_heads})"
        )
    return num_q_heads // num_kv_heads


def flat_token_view(cache: torch.Tensor) -> torch.Tensor | None:
    """View ``[num_blocks, block_size, H, D]`` as ``[num_blocks * block_size, H, D]`` without copying.

    Returns None when the strides do not allow it (e.g. a cache sliced out of a larger
    tensor along a middle axis); callers then index with (block, offset) pairs instead.
    """
    nb, bs, h, d = cache.shape
    try:
        return cache.view(nb * bs, h, d)
    except RuntimeError:
        return None


def require_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    """Triton kernels address the head dim with unit stride; reject anything else early."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dimension, got strides {t.stride()}")


def triton_dot_dtype(dtype: torch.dtype):
    """The ``tl`` dtype that attention kernels feed to ``tl.dot`` for activations of ``dtype``.

    Native bf16/fp16 on a GPU. The Triton interpreter multiplies bf16 operands as their raw
    16-bit integer patterns (numpy has no bfloat16), so there bf16 is upcast to fp32 first;
    every other part of the kernel runs unchanged.
    """
    import triton.language as tl

    if dtype == torch.float32 or (dtype == torch.bfloat16 and triton_interpreting()):
        return tl.float32
    if dtype == torch.bfloat16:
        return tl.bfloat16
    if dtype == torch.float16:
        return tl.float16
    raise ValueError(f"attention kernels support float32, bfloat16 and float16, got {dtype}")


def dot_precision(dot_dtype) -> str:
    """``input_precision`` for ``tl.dot``: exact IEEE products for fp32 operands (TF32 would
    lose ~3 decimal digits and break agreement with the fp32 reference); the Triton default
    otherwise, where the setting has no effect."""
    import triton.language as tl

    return "ieee" if dot_dtype == tl.float32 else "tf32"
