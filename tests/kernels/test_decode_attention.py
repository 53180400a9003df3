"""Paged decode attention: reference against naive dense attention, Triton against the reference."""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine.kernels import decode_attention
from kvmesh.engine.kernels.decode_attention import (
    MAX_SPLITS,
    MIN_TOKENS_PER_SPLIT,
    choose_num_splits,
    decode_chunk_rows,
    paged_decode_attention_ref,
    paged_decode_attention_triton,
)

from ._helpers import make_paged_batch, naive_decode, ulp_tolerance

# (num_q_heads, num_kv_heads, head_dim, block_size, seq_lens): GQA ratios 1/3/8, head dims
# 64/128, block sizes 1/16, lengths on and across block boundaries.
SHAPES = [
    (4, 4, 64, 16, [1, 16, 17, 40]),
    (9, 3, 64, 16, [31, 32, 33, 5]),
    (8, 1, 128, 1, [1, 7, 23]),
    (6, 2, 128, 16, [48, 3]),
]


def _case(shape, dtype, seed):
    hq, hkv, d, block_size, seq_lens = shape
    g = torch.Generator().manual_seed(seed)
    batch = make_paged_batch(seq_lens, hkv, d, block_size, dtype, g)
    q = torch.randn(len(seq_lens), hq, d, generator=g).to(dtype)
    return q, batch, d**-0.5


@pytest.mark.parametrize("shape", SHAPES)
def test_ref_matches_naive_fp32(shape):
    q, batch, scale = _case(shape, torch.float32, seed=len(shape[4]))
    out = paged_decode_attention_ref(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), naive_decode(q, batch, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("budget", [1, 40_000])
def test_ref_in_chunks_matches_naive(monkeypatch, budget):
    # A tiny budget forces one sequence per chunk; 40 kB gives chunks of a few sequences
    # with different context widths.
    monkeypatch.setattr(decode_attention, "REF_CHUNK_BYTES", budget)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # chunking is single-thread only
    q, batch, scale = _case((6, 2, 64, 16, [3, 40, 17, 64, 1, 33, 20]), torch.float32, seed=14)
    assert decode_chunk_rows(64, 2 * 64 * 4) < len(batch.seq_lens)
    out = paged_decode_attention_ref(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, scale)
    torch.testing.assert_close(out.double(), naive_decode(q, batch, scale), atol=1e-5, rtol=1e-5)


def test_decode_chunk_rows():
    assert decode_chunk_rows(400, 3 * 64 * 2, budget=4 << 20) == (4 << 20) // (2 * 400 * 384)
    assert decode_chunk_rows(10**6, 1024, budget=4 << 20) == 1


def test_ref_bf16_close_to_naive_and_max_seq_len_hint_is_equivalent():
    q, batch, scale = _case(SHAPES[1], torch.bfloat16, seed=4)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, scale)
    out = paged_decode_attention_ref(*args)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), naive_decode(q, batch, scale), atol=2e-2, rtol=2e-2)
    assert torch.equal(paged_decode_attention_ref(*args, max_seq_len=int(batch.seq_lens.max())), out)


@pytest.mark.parametrize("impl", [paged_decode_attention_ref, paged_decode_attention_triton])
def test_ignores_cache_content_beyond_seq_len(impl):
    q, batch, scale = _case(SHAPES[0], torch.float32, seed=8)
    args = (batch.block_tables, batch.seq_lens, scale)
    before = impl(q, batch.k_cache, batch.v_cache, *args)
    # Poison every slot past each sequence's end inside its last block, and every unused block.
    bs = batch.k_cache.shape[1]
    used = set()
    for i, n in enumerate(batch.seq_lens.tolist()):
        blocks = batch.block_tables[i, : -(-n // bs)].tolist()
        used.update(blocks)
        if n % bs:
            batch.k_cache[blocks[-1], n % bs :] = float("inf")
            batch.v_cache[blocks[-1], n % bs :] = float("nan")
    for b in set(range(batch.k_cache.shape[0])) - used:
        batch.k_cache[b] = float("nan")
    after = impl(q, batch.k_cache, batch.v_cache, *args)
    assert torch.equal(before, after)


def test_ref_rejects_narrow_block_table():
    q, batch, scale = _case(SHAPES[0], torch.float32, seed=1)
    with pytest.raises(ValueError, match="block_tables has only"):
        paged_decode_attention_ref(q, batch.k_cache, batch.v_cache, batch.block_tables[:, :1], batch.seq_lens, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_triton_matches_ref(shape, dtype, num_splits):
    q, batch, scale = _case(shape, dtype, seed=7)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, scale)
    expected = paged_decode_attention_ref(*args)
    got = paged_decode_attention_triton(*args, num_splits=num_splits)
    assert got.shape == q.shape and got.dtype == dtype
    torch.testing.assert_close(got, expected, **ulp_tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_long_context_with_automatic_splits(dtype):
    seq_lens = [3000, 1100]
    assert choose_num_splits(len(seq_lens), 2, max(seq_lens)) > 4
    q, batch, scale = _case((6, 2, 64, 16, seq_lens), dtype, seed=11)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, scale)
    expected = paged_decode_attention_ref(*args)
    torch.testing.assert_close(paged_decode_attention_triton(*args), expected, **ulp_tolerance(dtype))
    if dtype == torch.float32:
        torch.testing.assert_close(expected.double(), naive_decode(q, batch, scale), atol=1e-5, rtol=1e-5)


def test_triton_more_splits_than_tokens_leaves_empty_splits_harmless():
    q, batch, scale = _case((4, 2, 64, 1, [2, 1, 5]), torch.float32, seed=2)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, scale)
    torch.testing.assert_close(
        paged_decode_attention_triton(*args, num_splits=8), paged_decode_attention_ref(*args), atol=2e-5, rtol=2e-5
    )


def test_choose_num_splits():
    # Short contexts never split below the minimum tokens per split.
    assert choose_num_splits(1, 1, MIN_TOKENS_PER_SPLIT) == 1
    assert choose_num_splits(1, 1, MIN_TOKENS_PER_SPLIT + 1) == 2
    # A large batch already fills the device: no split.
    assert choose_num_splits(256, 8, 32768) == 1
    # Long context, single sequence: capped.
    assert choose_num_splits(1, 1, 10**7) == MAX_SPLITS
    # Occupancy bound: 2 programs per SM.
    assert choose_num_splits(4, 8, 100_000, num_sms=132) == -(-264 // 32)
    for b in (1, 3, 64):
        for n in (1, 100, 5000):
            assert 1 <= choose_num_splits(b, 3, n) <= MAX_SPLITS


@pytest.mark.parametrize("impl", [paged_decode_attention_ref, paged_decode_attention_triton])
def test_accepts_q_sliced_from_a_fused_projection(impl):
    hq, hkv, d = 6, 2, 64
    q, batch, scale = _case((hq, hkv, d, 16, [9, 20]), torch.float32, seed=13)
    qkv = torch.randn(2, (hq + 2 * hkv) * d)
    qkv[:, : hq * d] = q.reshape(2, -1)
    q_view = qkv[:, : hq * d].view(2, hq, d)  # row stride (hq + 2 hkv) * d
    assert not q_view.is_contiguous()
    args = (batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, scale)
    torch.testing.assert_close(impl(q_view, *args), paged_decode_attention_ref(q, *args), atol=2e-5, rtol=2e-5)
