"""Rotary position embedding (NeoX / HF ``rotate_half`` layout) fused with the KV-cache write.

``build_cos_sin_cache`` precomputes an fp32 table ``[max_position, head_dim]`` whose first
``head_dim/2`` columns hold ``cos(position * inv_freq)`` and last ``head_dim/2`` columns hold
``sin(...)``. The rotation then matches HF's ``apply_rotary_pos_emb``: HF casts cos/sin to the
activation dtype and evaluates ``q * cos + rotate_half(q) * sin`` in that dtype. The reference
runs exactly those torch ops (bit-identical to HF in every dtype); the Triton kernel rounds in
the same places and is compiled without multiply-add fusion, so on a GPU it should agree to the
last bit too (the CPU interpreter truncates fp32->bf16 casts, hence looser bf16 test bounds).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ._common import (
    check_gqa,
    check_kv_cache,
    check_triton_launch,
    flat_token_view,
    next_power_of_2,
    require_last_dim_contiguous,
)


class UnsupportedRopeScaling(ValueError):
    """The model's ``rope_scaling`` names a scheme kvmesh does not implement."""


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def _inv_freq(head_dim: int, base: float, device: torch.device | str | None) -> torch.Tensor:
    # Same expression and dtype path as HF so the table is bit-identical to theirs.
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (base ** exponent)


def _required(scaling: dict[str, Any], key: str, rope_type: str) -> float:
    if key not in scaling:
        raise UnsupportedRopeScaling(f"rope scaling {rope_type!r} needs the key {key!r}; got {sorted(scaling)}")
    return float(scaling[key])


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency remapping: long wavelengths divided by ``factor``, short ones kept,
    the band in between interpolated smoothly (same formula as HF's llama3 rope init)."""
    factor = _required(scaling, "factor", "llama3")
    low = _required(scaling, "low_freq_factor", "llama3")
    high = _required(scaling, "high_freq_factor", "llama3")
    old_ctx = _required(scaling, "original_max_position_embeddings", "llama3")
    if high == low:
        raise UnsupportedRopeScaling("llama3 rope scaling needs high_freq_factor != low_freq_factor")
    low_freq_wavelen = old_ctx / low
    high_freq_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_type_of(scaling: dict[str, Any] | None) -> str:
    """The scheme named by an HF ``rope_scaling``/``rope_parameters`` dict (``rope_type`` or legacy ``type``)."""
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def build_cos_sin_cache(
    head_dim: int,
    max_position: int,
    base: float,
    scaling: dict[str, Any] | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """fp32 ``[max_position, head_dim]``: cos of ``position * inv_freq`` then sin of it.

    Raises :class:`UnsupportedRopeScaling` for schemes other than default, linear and llama3.
    """
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"rotary head_dim must be a positive even number, got {head_dim}")
    if max_position <= 0:
        raise ValueError(f"max_position must be positive, got {max_position}")
    rope_type = rope_type_of(scaling)
    inv_freq = _inv_freq(head_dim, base, device)
    if rope_type == "linear":
        inv_freq = inv_freq / _required(scaling or {}, "factor", "linear")
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling or {})
    elif rope_type != "default":
        raise UnsupportedRopeScaling(
            f"rope scaling type {rope_type!r} is not supported; kvmesh implements "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}. Remove or change rope_scaling in the model config."
        )
    positions = torch.arange(max_position, dtype=torch.int64, device=device).float()
    freqs = positions[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).contiguous()


def _check_rope_inputs(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping) -> None:
    _, _, hkv, d = check_kv_cache(k_cache, v_cache)
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"q must be [T, Hq, D] and k, v [T, Hkv, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    t = q.shape[0]
    if k.shape[0] != t or positions.shape != (t,) or slot_mapping.shape != (t,):
        raise ValueError(f"q, k, v, positions and slot_mapping must all have {t} tokens")
    if q.shape[2] != d or k.shape[2] != d or k.shape[1] != hkv:
        raise ValueError(f"k/v of shape {tuple(k.shape)} do not match the cache's [*, *, {hkv}, {d}]")
    check_gqa(q.shape[1], hkv)
    if cos_sin.dim() != 2 or cos_sin.shape[1] != d:
        raise ValueError(f"cos_sin must be [max_position, {d}], got {tuple(cos_sin.shape)}")


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's ``x * cos + rotate_half(x) * sin`` with cos/sin of shape [T, 1, D] in x.dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_write_kv_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k at ``positions``, store rotated k and v at ``slot_mapping``; return (q_rot, k_rot).

    ``slot = block_id * block_size + offset``; every slot must be a valid cache position.
    """
    _check_rope_inputs(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)
    half = q.shape[-1] // 2
    table = cos_sin[positions]
    cos = table[:, :half].repeat(1, 2).to(q.dtype).unsqueeze(1)
    sin = table[:, half:].repeat(1, 2).to(q.dtype).unsqueeze(1)
    q_rot = _rotate(q, cos, sin)
    k_rot = _rotate(k, cos.to(k.dtype), sin.to(k.dtype))
    write_kv_ref(k_rot, v, k_cache, v_cache, slot_mapping)
    return q_rot, k_rot


def write_kv_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store k, v ``[T, Hkv, D]`` at ``slot_mapping`` (cast to the cache dtype)."""
    slots = slot_mapping.long()
    for src, cache in ((k, k_cache), (v, v_cache)):
        flat = flat_token_view(cache)
        if flat is not None:
            flat[slots] = src.to(cache.dtype)
        else:
            bs = cache.shape[1]
            cache[slots // bs, slots % bs] = src.to(cache.dtype)


def rope_write_kv_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`rope_write_kv_ref`: one program per token rotates all its heads
    and writes the cache in the same pass."""
    _check_rope_inputs(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)
    check_triton_launch(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)
    from ._rope_kernel import rope_write_kv_kernel

    t, hq, d = q.shape
    hkv = k.shape[1]
    q_rot = torch.empty_like(q, memory_format=torch.contiguous_format)
    k_rot = torch.empty_like(k, memory_format=torch.contiguous_format)
    cos_sin = cos_sin.float() if cos_sin.dtype != torch.float32 else cos_sin
    for name, x in (("q", q), ("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache), ("cos_sin", cos_sin)):
        require_last_dim_contiguous(name, x)
    if t:
        rope_write_kv_kernel[(t,)](
            q, k, v, positions, slot_mapping, cos_sin, k_cache, v_cache, q_rot, k_rot,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cos_sin.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            q_rot.stride(0), q_rot.stride(1), k_rot.stride(0), k_rot.stride(1),
            hq, hkv, k_cache.shape[1],
            HALF=d // 2,
            BLOCK_HQ=next_power_of_2(hq),
            BLOCK_HKV=next_power_of_2(hkv),
            BLOCK_HALF=next_power_of_2(d // 2),
            # No fused multiply-adds: keep the reference's rounding of each product.
            enable_fp_fusion=False,
        )
    return q_rot, k_rot
