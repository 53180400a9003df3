"""Triton kernels behind :func:`kvmesh.engine.kernels.decode_attention.paged_decode_attention_triton`.

Imported lazily: ``triton.jit`` decides between compiling and interpreting when this
module is first imported.

Softmax runs in base 2: scores are multiplied by ``scale * log2(e)`` so ``exp2`` can be used,
and the stored log-sum-exp is in log2 units too (only the reduce kernel reads it).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def decode_split_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, sl_ptr, part_ptr, lse_ptr,
    scale,
    stride_qb, stride_qh,
    stride_kcb, stride_kco, stride_kch,
    stride_vcb, stride_vco, stride_vch,
    stride_btb,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh, stride_ls,
    block_size, group, head_dim, num_splits,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DIRECT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (seq, kv_head, split): attend the G query heads of kv_head to one token range.

    The sequence's tokens are divided into num_splits ranges of equal length rounded up to
    BLOCK_N; a range past the end is empty and reports lse = -inf with a zero output.
    DIRECT (num_splits == 1) writes the normalised output in the output dtype instead.
    """
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(sl_ptr + seq).to(tl.int32)
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    rows = tl.arange(0, BLOCK_H)
    heads = kv_head * group + rows
    row_mask = rows < group
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=row_mask[:, None] & d_mask[None, :], other=0.0,
    ).to(DOT_DTYPE)
    qk_scale = scale * 1.4426950408889634  # log2(e): softmax in base 2

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    bt_row = bt_ptr + seq * stride_btb
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        tok_mask = tok < end
        block_id = tl.load(bt_row + tok // block_size, mask=tok_mask, other=0).to(tl.int64)
        offset = (tok % block_size).to(tl.int64)
        kv_mask = tok_mask[:, None] & d_mask[None, :]
        k = tl.load(
            kc_ptr + block_id[:, None] * stride_kcb + offset[:, None] * stride_kco
            + kv_head * stride_kch + d[None, :],
            mask=kv_mask, other=0.0,
        )
        s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(tok_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            vc_ptr + block_id[:, None] * stride_vcb + offset[:, None] * stride_vco
            + kv_head * stride_vch + d[None, :],
            mask=kv_mask, other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        m_i = m_new

    # An empty range leaves l_i == 0; divide by 1 instead so its output is 0, not NaN.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_ptrs = part_ptr + seq * stride_pb + heads[:, None] * stride_ph + split * stride_ps + d[None, :]
    out_mask = row_mask[:, None] & d_mask[None, :]
    if DIRECT:
        tl.store(out_ptrs, out.to(part_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(out_ptrs, out, mask=out_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + seq * stride_lb + heads * stride_lh + split * stride_ls, lse, mask=row_mask)


@triton.jit
def decode_reduce_kernel(
    part_ptr, lse_ptr, out_ptr,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    num_splits, head_dim,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program (seq, q_head): weight each split's output by exp2(lse_s - max lse) and normalise."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_mask = s < num_splits
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    lse = tl.load(lse_ptr + seq * stride_lb + head * stride_lh + s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    # All splits empty only for seq_len == 0; keep the weights finite so the output is 0.
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    parts = tl.load(
        part_ptr + seq * stride_pb + head * stride_ph + s[:, None] * stride_ps + d[None, :],
        mask=s_mask[:, None] & d_mask[None, :], other=0.0,
    )
    total = tl.sum(w, axis=0)
    out = tl.sum(parts * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)
