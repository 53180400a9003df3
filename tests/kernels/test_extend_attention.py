"""Paged extend attention: reference against naive causal attention, Triton against the reference."""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine.kernels.decode_attention import paged_decode_attention_ref
from kvmesh.engine.kernels.extend_attention import paged_extend_attention_ref, paged_extend_attention_triton

from ._helpers import make_paged_batch, naive_extend, ulp_tolerance

# (num_q_heads, num_kv_heads, head_dim, block_size, seq_lens, q_lens): GQA 1/3/8, head dims
# 64/128, block sizes 1/16; q_len = 1, q_len = whole sequence (plain prefill), and chunks that
# start and end inside blocks.
SHAPES = [
    (4, 4, 64, 16, [1, 40, 33], [1, 40, 9]),
    (9, 3, 64, 16, [17, 70, 5], [1, 70, 5]),
    (8, 1, 128, 1, [12, 30], [12, 4]),
    (6, 2, 128, 16, [48, 16, 20], [15, 16, 1]),
]


def _case(shape, dtype, seed):
    hq, hkv, d, block_size, seq_lens, q_lens = shape
    g = torch.Generator().manual_seed(seed)
    batch = make_paged_batch(seq_lens, hkv, d, block_size, dtype, g)
    qsl = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    q = torch.randn(int(qsl[-1]), hq, d, generator=g).to(dtype)
    return q, batch, qsl, d**-0.5


def _args(q, batch, qsl, scale):
    return (q, batch.k_cache, batch.v_cache, batch.block_tables, qsl, batch.seq_lens, scale)


@pytest.mark.parametrize("shape", SHAPES)
def test_ref_matches_naive_fp32(shape):
    q, batch, qsl, scale = _case(shape, torch.float32, seed=3)
    out = paged_extend_attention_ref(*_args(q, batch, qsl, scale))
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), naive_extend(q, batch, qsl, scale), atol=1e-5, rtol=1e-5)


def test_ref_bf16_close_to_naive():
    q, batch, qsl, scale = _case(SHAPES[1], torch.bfloat16, seed=5)
    out = paged_extend_attention_ref(*_args(q, batch, qsl, scale))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), naive_extend(q, batch, qsl, scale), atol=2e-2, rtol=2e-2)


def test_ref_single_token_queries_equal_decode():
    seq_lens = [5, 33, 16]
    q, batch, qsl, scale = _case((6, 2, 64, 16, seq_lens, [1, 1, 1]), torch.float32, seed=6)
    extend = paged_extend_attention_ref(*_args(q, batch, qsl, scale))
    decode = paged_decode_attention_ref(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, scale)
    torch.testing.assert_close(extend, decode, atol=1e-6, rtol=1e-6)


def test_ref_rejects_more_queries_than_context():
    q, batch, _, scale = _case(SHAPES[0], torch.float32, seed=1)
    bad_qsl = torch.tensor([0, 2, 42, 51], dtype=torch.int32)  # 2 new tokens in a context of 1
    with pytest.raises(ValueError, match="new tokens but a context of only"):
        paged_extend_attention_ref(*_args(q, batch, bad_qsl, scale))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_matches_ref(shape, dtype):
    q, batch, qsl, scale = _case(shape, dtype, seed=9)
    args = _args(q, batch, qsl, scale)
    expected = paged_extend_attention_ref(*args)
    got = paged_extend_attention_triton(*args)
    assert got.shape == q.shape and got.dtype == dtype
    torch.testing.assert_close(got, expected, **ulp_tolerance(dtype))


def test_triton_long_prefill_with_prefix_spanning_many_tiles():
    # 150 new tokens after a 90-token prefix: several query tiles and KV tiles, GQA 3.
    q, batch, qsl, scale = _case((6, 2, 64, 16, [240, 7], [150, 7]), torch.float32, seed=12)
    args = _args(q, batch, qsl, scale)
    torch.testing.assert_close(paged_extend_attention_triton(*args), paged_extend_attention_ref(*args), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(
        paged_extend_attention_ref(*args).double(), naive_extend(q, batch, qsl, scale), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("impl", [paged_extend_attention_ref, paged_extend_attention_triton])
def test_sequences_without_new_tokens_are_skipped(impl):
    q, batch, _, scale = _case((4, 2, 64, 16, [10, 20, 6], [3, 0, 6]), torch.float32, seed=4)
    qsl = torch.tensor([0, 3, 3, 9], dtype=torch.int32)
    out = impl(*_args(q, batch, qsl, scale))
    torch.testing.assert_close(out.double(), naive_extend(q, batch, qsl, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", [paged_extend_attention_ref, paged_extend_attention_triton])
def test_ignores_cache_content_beyond_seq_len(impl):
    q, batch, qsl, scale = _case(SHAPES[3], torch.float32, seed=8)
    before = impl(*_args(q, batch, qsl, scale))
    bs = batch.k_cache.shape[1]
    for i, n in enumerate(batch.seq_lens.tolist()):
        last = int(batch.block_tables[i, (n - 1) // bs])
        batch.k_cache[last, (n - 1) % bs + 1 :] = float("inf")
        batch.v_cache[last, (n - 1) % bs + 1 :] = float("nan")
    assert torch.equal(impl(*_args(q, batch, qsl, scale)), before)


@pytest.mark.parametrize("impl", [paged_extend_attention_ref, paged_extend_attention_triton])
def test_accepts_q_sliced_from_a_fused_projection(impl):
    hq, hkv, d = 6, 2, 64
    q, batch, qsl, scale = _case((hq, hkv, d, 16, [9, 20], [9, 4]), torch.float32, seed=13)
    t = q.shape[0]
    qkv = torch.randn(t, (hq + 2 * hkv) * d)
    qkv[:, : hq * d] = q.reshape(t, -1)
    q_view = qkv[:, : hq * d].view(t, hq, d)
    assert not q_view.is_contiguous()
    expected = paged_extend_attention_ref(*_args(q, batch, qsl, scale))
    torch.testing.assert_close(impl(*_args(q_view, batch, qsl, scale)), expected, atol=2e-5, rtol=2e-5)


def test_max_query_len_hint_is_accepted_by_both():
    q, batch, qsl, scale = _case(SHAPES[0], torch.float32, seed=2)
    args = _args(q, batch, qsl, scale)
    ref = paged_extend_attention_ref(*args, max_query_len=40)
    torch.testing.assert_close(paged_extend_attention_triton(*args, max_query_len=40), ref, atol=2e-5, rtol=2e-5)
