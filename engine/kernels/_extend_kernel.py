"""Triton kernel behind :func:`kvmesh.engine.kernels.extend_attention.paged_extend_attention_triton`.

Imported lazily: ``triton.jit`` decides between compiling and interpreting when this
module is first imported.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def extend_attention_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, qsl_ptr, sl_ptr, out_ptr,
    scale,
    stride_qt, stride_qh,
    stride_kcb, stride_kco, stride_kch,
    stride_vcb, stride_vco, stride_vch,
    stride_btb,
    stride_ot, stride_oh,
    block_size, group, head_dim,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (seq, kv_head, tile): query rows r = t * group + g for the tile's tokens t and the
    group's heads g, so one K/V tile serves all G heads sharing kv_head.

    Row (t, g) is query token tile*(BLOCK_M // group) + t of the sequence, at absolute position
    seq_len - q_len + that index; it sees keys at positions <= its own. Tiles past q_len do no
    work and store nothing.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)

    q_start = tl.load(qsl_ptr + seq).to(tl.int64)
    q_len = (tl.load(qsl_ptr + seq + 1) - tl.load(qsl_ptr + seq)).to(tl.int32)
    seq_len = tl.load(sl_ptr + seq).to(tl.int32)
    prefix = seq_len - q_len
    tokens_per_tile = BLOCK_M // group
    tok_start = tile * tokens_per_tile

    r = tl.arange(0, BLOCK_M)
    t = r // group
    tok = tok_start + t
    head = kv_head * group + r % group
    row_mask = (t < tokens_per_tile) & (tok < q_len)
    row_pos = prefix + tok
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    io_mask = row_mask[:, None] & d_mask[None, :]

    q = tl.load(
        q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=io_mask, other=0.0,
    ).to(DOT_DTYPE)
    qk_scale = scale * 1.4426950408889634  # log2(e): softmax in base 2

    # Keys beyond the tile's last query position are masked for every row: stop there.
    last_tok = tl.minimum(tok_start + tokens_per_tile, q_len)
    kv_end = tl.where(tok_start < q_len, prefix + last_tok, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_btb
    for n0 in range(0, kv_end, BLOCK_N):
        kv_tok = n0 + tl.arange(0, BLOCK_N)
        kv_valid = kv_tok < kv_end
        block_id = tl.load(bt_row + kv_tok // block_size, mask=kv_valid, other=0).to(tl.int64)
        offset = (kv_tok % block_size).to(tl.int64)
        kv_mask = kv_valid[:, None] & d_mask[None, :]
        k = tl.load(
            kc_ptr + block_id[:, None] * stride_kcb + offset[:, None] * stride_kco
            + kv_head * stride_kch + d[None, :],
            mask=kv_mask, other=0.0,
        )
        s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * qk_scale
        visible = (kv_tok[None, :] <= row_pos[:, None]) & kv_valid[None, :] & row_mask[:, None]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Rows with nothing visible yet (padding rows) keep m = -inf; shift them by 0 so that
        # exp2 yields 0 instead of NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            vc_ptr + block_id[:, None] * stride_vcb + offset[:, None] * stride_vco
            + kv_head * stride_vch + d[None, :],
            mask=kv_mask, other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty), mask=io_mask,
    )
