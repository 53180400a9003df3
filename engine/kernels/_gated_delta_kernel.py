"""Triton kernels behind :mod:`kvmesh.engine.kernels.gated_delta_triton` (the gated delta rule).

Imported lazily: ``triton.jit`` decides between compiling and interpreting when this
module is first imported. Everything is fp32 (inputs, gates, state); ``tl.dot`` runs at
``DOT_PRECISION``, which the wrapper sets to "ieee": the recurrent state accumulates over a
whole sequence, and TF32 products would drift from the fp32 reference the engine is held to.

Chunked prefill is two launches:

1. ``gd_chunk_prep_kernel``, one program per (sequence, head, chunk), all chunks in
   parallel: the chunk's cumulative log decay, the strictly lower matrix
   ``A = (beta k) k^T * exp(cum_i - cum_j)``, ``T = (I + A)^-1`` by forward substitution, and
   the WY/UT factors ``u = T (beta v)`` and ``w = T (beta k exp(cum))``, into scratch rows.
2. ``gd_chunk_scan_kernel``, one program per (sequence, head, Dv tile): the state tile stays in
   registers while the program walks the chunks in order, writing outputs, mid-chunk captures
   and the final state.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gd_chunk_prep_kernel(
    k_ptr, v_ptr, g_ptr, beta_ptr, u_ptr, w_ptr, cum_ptr,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_gb, stride_gh, stride_gt,
    stride_bb, stride_bh, stride_bt,
    num_heads, seq_len, num_chunks, dk, dv,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BDV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (b * H + h, chunk). Rows past ``seq_len`` load as zeros (g = beta = 0: decay 1, no
    write), so every one of the chunk's BT scratch rows is written and the scan reads them unmasked.

    Scratch layout: row ``(b * H + h) * num_chunks * BT + t`` of u [*, dv], w [*, dk], cum [*].
    """
    bh = tl.program_id(0)
    chunk = tl.program_id(1)
    b = bh // num_heads
    h = bh % num_heads
    i = tl.arange(0, BT)
    rows = chunk * BT + i
    row_ok = rows < seq_len
    dk_r = tl.arange(0, BK)
    dv_r = tl.arange(0, BDV)
    dk_ok = dk_r < dk
    dv_ok = dv_r < dv

    k = tl.load(k_ptr + b.to(tl.int64) * stride_kb + h * stride_kh + rows[:, None].to(tl.int64) * stride_kt
                + dk_r[None, :], mask=row_ok[:, None] & dk_ok[None, :], other=0.0).to(tl.float32)
    v = tl.load(v_ptr + b.to(tl.int64) * stride_vb + h * stride_vh + rows[:, None].to(tl.int64) * stride_vt
                + dv_r[None, :], mask=row_ok[:, None] & dv_ok[None, :], other=0.0).to(tl.float32)
    g = tl.load(g_ptr + b.to(tl.int64) * stride_gb + h * stride_gh + rows.to(tl.int64) * stride_gt,
                mask=row_ok, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + b.to(tl.int64) * stride_bb + h * stride_bh + rows.to(tl.int64) * stride_bt,
                   mask=row_ok, other=0.0).to(tl.float32)
    cum = tl.cumsum(g, 0)  # log of the decay from the chunk's start through each row

    strict = i[:, None] > i[None, :]
    k_beta = k * beta[:, None]
    kk = tl.dot(k_beta, tl.trans(k), input_precision=DOT_PRECISION)
    # The exponent is zeroed above the diagonal before exp: cum_i - cum_j > 0 there and could overflow.
    a = tl.where(strict, kk * tl.exp(tl.where(strict, cum[:, None] - cum[None, :], 0.0)), 0.0)

    # T = (I + A)^-1, A strictly lower: row r of T is e_r - sum_{j<r} A[r, j] T[j, :]. Rows j < r
    # are final when row r is formed, and A[r, j] = 0 for j >= r, so the whole T can be used.
    eye = i[:, None] == i[None, :]
    t = tl.where(eye, 1.0, 0.0)
    for r in range(1, BT):
        a_r = tl.sum(tl.where(i[:, None] == r, a, 0.0), 0)  # A[r, :], indexed by j
        t_r = tl.where(i == r, 1.0, 0.0) - tl.sum(a_r[:, None] * t, 0)
        t = tl.where(i[:, None] == r, t_r[None, :], t)

    u = tl.dot(t, v * beta[:, None], input_precision=DOT_PRECISION)
    w = tl.dot(t, k_beta * tl.exp(cum)[:, None], input_precision=DOT_PRECISION)
    srow = (bh.to(tl.int64) * num_chunks + chunk) * BT + i
    tl.store(u_ptr + srow[:, None] * dv + dv_r[None, :], u, mask=dv_ok[None, :])
    tl.store(w_ptr + srow[:, None] * dk + dk_r[None, :], w, mask=dk_ok[None, :])
    tl.store(cum_ptr + srow, cum)


@triton.jit
def gd_chunk_scan_kernel(
    q_ptr, k_ptr, u_ptr, w_ptr, cum_ptr, s0_ptr, out_ptr, s1_ptr,
    cap_tok_ptr, cap_row_ptr, cap_lo_ptr, cap_ptr,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_s0b, stride_s0h, stride_s0k,
    stride_ob, stride_oh, stride_ot,
    num_heads, seq_len, num_chunks, dk, dv,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_CAPTURE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (b * H + h, Dv tile): columns ``tile * BV ..`` of the state, walked through the chunks.

    Per chunk, with S the state at its start: ``v_new = u - w S`` (the corrected values),
    ``out = (q exp(cum)) S + (q k^T * decay, lower incl. diagonal) v_new`` and
    ``S' = exp(cum_last) S + (k exp(cum_last - cum))^T v_new``.

    Captures of sequence b are entries ``cap_lo[b] .. cap_lo[b+1]`` of (cap_tok, cap_row), sorted
    by token count: the state after ``tok`` tokens goes to row ``cap_row`` of ``cap`` [N, H, dk, dv]
    (contiguous). Each is taken in the chunk holding token ``tok - 1``.
    """
    bh = tl.program_id(0)
    tile = tl.program_id(1)
    b = bh // num_heads
    h = bh % num_heads
    i = tl.arange(0, BT)
    dk_r = tl.arange(0, BK)
    dv_c = tile * BV + tl.arange(0, BV)
    dk_ok = dk_r < dk
    dv_ok = dv_c < dv
    s_mask = dk_ok[:, None] & dv_ok[None, :]
    causal = i[:, None] >= i[None, :]

    s0 = s0_ptr + b.to(tl.int64) * stride_s0b + h * stride_s0h
    s = tl.load(s0 + dk_r[:, None] * stride_s0k + dv_c[None, :], mask=s_mask, other=0.0).to(tl.float32)
    q_base = q_ptr + b.to(tl.int64) * stride_qb + h * stride_qh
    k_base = k_ptr + b.to(tl.int64) * stride_kb + h * stride_kh
    o_base = out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh
    if HAS_CAPTURE:
        ci = tl.load(cap_lo_ptr + b)
        ci_end = tl.load(cap_lo_ptr + b + 1)
    for c in range(num_chunks):  # in order: each chunk starts from the state the previous one left
        rows = c * BT + i
        row_ok = rows < seq_len
        io_k = row_ok[:, None] & dk_ok[None, :]
        q = tl.load(q_base + rows[:, None].to(tl.int64) * stride_qt + dk_r[None, :], mask=io_k, other=0.0)
        k = tl.load(k_base + rows[:, None].to(tl.int64) * stride_kt + dk_r[None, :], mask=io_k, other=0.0)
        q = q.to(tl.float32)
        k = k.to(tl.float32)
        srow = (bh.to(tl.int64) * num_chunks + c) * BT + i
        u = tl.load(u_ptr + srow[:, None] * dv + dv_c[None, :], mask=dv_ok[None, :], other=0.0)
        w = tl.load(w_ptr + srow[:, None] * dk + dk_r[None, :], mask=dk_ok[None, :], other=0.0)
        cum = tl.load(cum_ptr + srow)

        v_new = u - tl.dot(w, s, input_precision=DOT_PRECISION)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        attn = tl.where(causal, qk * tl.exp(tl.where(causal, cum[:, None] - cum[None, :], 0.0)), 0.0)
        o = tl.dot(q * tl.exp(cum)[:, None], s, input_precision=DOT_PRECISION)
        o += tl.dot(attn, v_new, input_precision=DOT_PRECISION)
        tl.store(o_base + rows[:, None].to(tl.int64) * stride_ot + dv_c[None, :], o,
                 mask=row_ok[:, None] & dv_ok[None, :])

        if HAS_CAPTURE:
            chunk_end = (c + 1) * BT
            tok = tl.load(cap_tok_ptr + ci, mask=ci < ci_end, other=2147483647)
            while tok <= chunk_end:
                m = tok - c * BT  # tokens of this chunk inside the capture, 1..BT
                c_end = tl.sum(tl.where(i == m - 1, cum, 0.0), 0)
                inside = i < m
                keep = tl.where(inside, tl.exp(tl.where(inside, c_end - cum, 0.0)), 0.0)
                s_m = s * tl.exp(c_end) + tl.dot(tl.trans(k * keep[:, None]), v_new, input_precision=DOT_PRECISION)
                row = tl.load(cap_row_ptr + ci).to(tl.int64)
                dst = cap_ptr + (row * num_heads + h) * dk * dv
                tl.store(dst + dk_r[:, None] * dv + dv_c[None, :], s_m, mask=s_mask)
                ci += 1
                tok = tl.load(cap_tok_ptr + ci, mask=ci < ci_end, other=2147483647)

        c_last = tl.sum(tl.where(i == BT - 1, cum, 0.0), 0)
        k_dec = k * tl.exp(c_last - cum)[:, None]
        s = s * tl.exp(c_last) + tl.dot(tl.trans(k_dec), v_new, input_precision=DOT_PRECISION)

    s1 = s1_ptr + bh.to(tl.int64) * dk * dv
    tl.store(s1 + dk_r[:, None] * dv + dv_c[None, :], s, mask=s_mask)


@triton.jit
def gd_recurrent_step_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s0_ptr, out_ptr, s1_ptr,
    stride_qb, stride_qh,
    stride_kb, stride_kh,
    stride_vb, stride_vh,
    stride_gb, stride_gh,
    stride_bb, stride_bh,
    stride_s0b, stride_s0h, stride_s0k,
    num_heads, dk, dv,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    """Program (b * H + h, Dv tile): one token of one sequence. ``S = exp(g) S``, then the delta
    write ``S += k (beta (v - k^T S))^T`` and ``o = S^T q``; the new state goes to s1 [B, H, dk, dv]
    (contiguous), so the input state is left untouched."""
    bh = tl.program_id(0)
    tile = tl.program_id(1)
    b = (bh // num_heads).to(tl.int64)
    h = bh % num_heads
    dk_r = tl.arange(0, BK)
    dv_c = tile * BV + tl.arange(0, BV)
    dk_ok = dk_r < dk
    dv_ok = dv_c < dv
    s_mask = dk_ok[:, None] & dv_ok[None, :]

    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + dk_r, mask=dk_ok, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * stride_kb + h * stride_kh + dk_r, mask=dk_ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + b * stride_vb + h * stride_vh + dv_c, mask=dv_ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + b * stride_gb + h * stride_gh).to(tl.float32)
    beta = tl.load(beta_ptr + b * stride_bb + h * stride_bh).to(tl.float32)
    s = tl.load(s0_ptr + b * stride_s0b + h * stride_s0h + dk_r[:, None] * stride_s0k + dv_c[None, :],
                mask=s_mask, other=0.0).to(tl.float32)
    s = s * tl.exp(g)
    kv_mem = tl.sum(s * k[:, None], 0)
    delta = (v - kv_mem) * beta
    s = s + k[:, None] * delta[None, :]
    o = tl.sum(s * q[:, None], 0)
    tl.store(out_ptr + bh.to(tl.int64) * dv + dv_c, o, mask=dv_ok)
    tl.store(s1_ptr + bh.to(tl.int64) * dk * dv + dk_r[:, None] * dv + dv_c[None, :], s, mask=s_mask)
