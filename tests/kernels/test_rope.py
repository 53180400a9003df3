"""RoPE: cos/sin table and rotation against HF, fused Triton rotate + cache write against the reference."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from kvmesh.engine.kernels.rope import (
    UnsupportedRopeScaling,
    build_cos_sin_cache,
    rope_write_kv_ref,
    rope_write_kv_triton,
)

from ._helpers import ulp_tolerance

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _hf_cos_sin(head_dim: int, base: float, scaling: dict | None, positions: torch.Tensor):
    config = LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        rope_theta=base,
        rope_scaling=dict(scaling) if scaling else None,
        max_position_embeddings=131072,
    )
    rotary = LlamaRotaryEmbedding(config)
    cos, sin = rotary(torch.zeros(1), positions[None])
    return cos[0], sin[0]


@pytest.mark.parametrize(
    "scaling",
    [None, {"rope_type": "default"}, {"rope_type": "linear", "factor": 4.0}, {"type": "linear", "factor": 2.0}, LLAMA3],
    ids=["none", "default", "linear", "legacy-type-linear", "llama3"],
)
@pytest.mark.parametrize("head_dim,base", [(64, 100000.0), (128, 500000.0)])
def test_cos_sin_cache_matches_hf(scaling, head_dim, base):
    positions = torch.tensor([0, 1, 2, 17, 1000, 8191, 20000, 40000])
    table = build_cos_sin_cache(head_dim, 40001, base, scaling)
    assert table.shape == (40001, head_dim) and table.dtype == torch.float32
    cos, sin = _hf_cos_sin(head_dim, base, scaling, positions)
    half = head_dim // 2
    torch.testing.assert_close(table[positions, :half].repeat(1, 2), cos, atol=1e-6, rtol=0)
    torch.testing.assert_close(table[positions, half:].repeat(1, 2), sin, atol=1e-6, rtol=0)


def test_llama3_scaling_changes_low_frequencies_only():
    plain = build_cos_sin_cache(128, 4096, 500000.0)
    scaled = build_cos_sin_cache(128, 4096, 500000.0, LLAMA3)
    assert torch.equal(plain[:, :8], scaled[:, :8])  # high-frequency pairs untouched
    assert not torch.allclose(plain[:, 56:64], scaled[:, 56:64])


@pytest.mark.parametrize("scaling", [{"rope_type": "yarn", "factor": 4.0}, {"type": "dynamic", "factor": 2.0}])
def test_unsupported_scaling_raises(scaling):
    with pytest.raises(UnsupportedRopeScaling, match="not supported"):
        build_cos_sin_cache(64, 128, 10000.0, scaling)
    assert issubclass(UnsupportedRopeScaling, ValueError)


def test_llama3_missing_key_raises():
    with pytest.raises(UnsupportedRopeScaling, match="low_freq_factor"):
        build_cos_sin_cache(64, 128, 10000.0, {"rope_type": "llama3", "factor": 8.0})


def _inputs(t, hq, hkv, d, num_blocks, block_size, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    k = torch.randn(t, hkv, d, generator=g).to(dtype)
    v = torch.randn(t, hkv, d, generator=g).to(dtype)
    positions = torch.randint(0, 300, (t,), generator=g)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t]
    return q, k, v, positions, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ref_matches_hf_apply_rotary_and_writes_slots(dtype):
    d, block_size, num_blocks = 64, 16, 4
    q, k, v, positions, slots = _inputs(9, 6, 2, d, num_blocks, block_size, dtype, seed=5)
    table = build_cos_sin_cache(d, 300, 10000.0)
    k_cache = torch.zeros(num_blocks, block_size, 2, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    q_rot, k_rot = rope_write_kv_ref(q, k, v, positions, table, k_cache, v_cache, slots)

    cos, sin = _hf_cos_sin(d, 10000.0, None, positions)
    # HF casts cos/sin to the activation dtype and works on [batch, heads, seq, dim].
    q_hf, k_hf = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None].to(dtype), sin[None].to(dtype)
    )
    assert torch.equal(q_rot, q_hf[0].transpose(0, 1))
    assert torch.equal(k_rot, k_hf[0].transpose(0, 1))

    flat_k = k_cache.view(-1, 2, d)
    flat_v = v_cache.view(-1, 2, d)
    assert torch.equal(flat_k[slots], k_rot) and torch.equal(flat_v[slots], v)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert not flat_k[untouched].any() and not flat_v[untouched].any()


def _strided_caches(num_blocks, block_size, hkv, d, dtype):
    """K and V as views into one [num_blocks, 2, block_size, H, D] tensor (not flattenable)."""
    both = torch.zeros(num_blocks, 2, block_size, hkv, d, dtype=dtype)
    return both[:, 0], both[:, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "hq,hkv,d,block_size,strided",
    [(6, 2, 64, 16, False), (8, 8, 128, 1, False), (9, 3, 64, 16, True), (4, 1, 128, 1, True)],
)
def test_triton_matches_ref(dtype, hq, hkv, d, block_size, strided):
    num_blocks = -(-40 // block_size) + 1
    q, k, v, positions, slots = _inputs(11, hq, hkv, d, num_blocks, block_size, dtype, seed=hq + d)
    table = build_cos_sin_cache(d, 300, 100000.0, LLAMA3)
    if strided:
        caches_ref = _strided_caches(num_blocks, block_size, hkv, d, dtype)
        caches_tri = _strided_caches(num_blocks, block_size, hkv, d, dtype)
    else:
        caches_ref = tuple(torch.zeros(num_blocks, block_size, hkv, d, dtype=dtype) for _ in range(2))
        caches_tri = tuple(torch.zeros(num_blocks, block_size, hkv, d, dtype=dtype) for _ in range(2))
    expected = rope_write_kv_ref(q, k, v, positions, table, *caches_ref, slots)
    got = rope_write_kv_triton(q, k, v, positions, table, *caches_tri, slots)
    tol = ulp_tolerance(dtype)
    for a, b in zip(got + caches_tri, expected + caches_ref):
        torch.testing.assert_close(a, b, **tol)
    # V is copied, never rounded differently.
    assert torch.equal(caches_tri[1], caches_ref[1])


def test_triton_writes_into_bf16_cache_from_fp32_activations():
    q, k, v, positions, slots = _inputs(5, 4, 2, 64, 2, 16, torch.float32, seed=9)
    table = build_cos_sin_cache(64, 300, 10000.0)
    k_ref, v_ref = (torch.zeros(2, 16, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    k_tri, v_tri = (torch.zeros(2, 16, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    q_a, k_a = rope_write_kv_ref(q, k, v, positions, table, k_ref, v_ref, slots)
    q_b, k_b = rope_write_kv_triton(q, k, v, positions, table, k_tri, v_tri, slots)
    torch.testing.assert_close(q_b, q_a)
    torch.testing.assert_close(k_tri, k_ref, **ulp_tolerance(torch.bfloat16))


def test_rejects_mismatched_shapes():
    q, k, v, positions, slots = _inputs(3, 4, 2, 64, 2, 16, torch.float32, seed=1)
    table = build_cos_sin_cache(64, 300, 10000.0)
    cache = torch.zeros(2, 16, 3, 64)
    with pytest.raises(ValueError, match="do not match"):
        rope_write_kv_ref(q, k, v, positions, table, cache, cache.clone(), slots)


def test_triton_accepts_views_of_a_fused_qkv_projection():
    t, hq, hkv, d = 6, 4, 2, 64
    g = torch.Generator().manual_seed(21)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    positions = torch.arange(t) * 7
    slots = torch.tensor([3, 4, 5, 16, 17, 30])
    table = build_cos_sin_cache(d, 64, 10000.0)
    caches_ref = [torch.zeros(2, 16, hkv, d) for _ in range(2)]
    caches_tri = [torch.zeros(2, 16, hkv, d) for _ in range(2)]
    expected = rope_write_kv_ref(q, k, v, positions, table, *caches_ref, slots)
    got = rope_write_kv_triton(q, k, v, positions, table, *caches_tri, slots)
    for a, b in zip((*got, *caches_tri), (*expected, *caches_ref)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
