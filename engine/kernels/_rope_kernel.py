"""Triton kernel behind :func:`kvmesh.engine.kernels.rope.rope_write_kv_triton`.

Imported lazily: ``triton.jit`` decides between compiling and interpreting when this
module is first imported.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rotate_halves(x1, x2, c, s, OUT_DTYPE: tl.constexpr):
    """HF's ``x * cos + rotate_half(x) * sin`` on the two halves, rounding to OUT_DTYPE after each
    product and after the sum exactly as eager torch does (no-ops for fp32)."""
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    c = c.to(OUT_DTYPE).to(tl.float32)
    s = s.to(OUT_DTYPE).to(tl.float32)
    lo = (x1 * c).to(OUT_DTYPE).to(tl.float32) + (-x2 * s).to(OUT_DTYPE).to(tl.float32)
    hi = (x2 * c).to(OUT_DTYPE).to(tl.float32) + (x1 * s).to(OUT_DTYPE).to(tl.float32)
    return lo.to(OUT_DTYPE), hi.to(OUT_DTYPE)


@triton.jit
def rope_write_kv_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, slot_ptr, cs_ptr, kc_ptr, vc_ptr, qo_ptr, ko_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cs,
    stride_kcb, stride_kco, stride_kch,
    stride_vcb, stride_vco, stride_vch,
    stride_qot, stride_qoh, stride_kot, stride_koh,
    num_q_heads, num_kv_heads, block_size,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """One program per token: rotate its q and k heads, write k_rot and v to the token's slot."""
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    block = slot // block_size
    offset = slot % block_size

    d = tl.arange(0, BLOCK_HALF)
    dmask = d < HALF
    c = tl.load(cs_ptr + pos * stride_cs + d, mask=dmask, other=0.0)[None, :]
    s = tl.load(cs_ptr + pos * stride_cs + HALF + d, mask=dmask, other=0.0)[None, :]

    hq = tl.arange(0, BLOCK_HQ)[:, None]
    qmask = (hq < num_q_heads) & dmask[None, :]
    q_base = q_ptr + tok * stride_qt + hq * stride_qh + d[None, :]
    q1 = tl.load(q_base, mask=qmask, other=0.0)
    q2 = tl.load(q_base + HALF, mask=qmask, other=0.0)
    qo1, qo2 = _rotate_halves(q1, q2, c, s, qo_ptr.dtype.element_ty)
    qo_base = qo_ptr + tok * stride_qot + hq * stride_qoh + d[None, :]
    tl.store(qo_base, qo1, mask=qmask)
    tl.store(qo_base + HALF, qo2, mask=qmask)

    hk = tl.arange(0, BLOCK_HKV)[:, None]
    kmask = (hk < num_kv_heads) & dmask[None, :]
    k_base = k_ptr + tok * stride_kt + hk * stride_kh + d[None, :]
    k1 = tl.load(k_base, mask=kmask, other=0.0)
    k2 = tl.load(k_base + HALF, mask=kmask, other=0.0)
    ko1, ko2 = _rotate_halves(k1, k2, c, s, ko_ptr.dtype.element_ty)
    ko_base = ko_ptr + tok * stride_kot + hk * stride_koh + d[None, :]
    tl.store(ko_base, ko1, mask=kmask)
    tl.store(ko_base + HALF, ko2, mask=kmask)

    kc_base = kc_ptr + block * stride_kcb + offset * stride_kco + hk * stride_kch + d[None, :]
    tl.store(kc_base, ko1.to(kc_ptr.dtype.element_ty), mask=kmask)
    tl.store(kc_base + HALF, ko2.to(kc_ptr.dtype.element_ty), mask=kmask)

    v_base = v_ptr + tok * stride_vt + hk * stride_vh + d[None, :]
    vc_base = vc_ptr + block * stride_vcb + offset * stride_vco + hk * stride_vch + d[None, :]
    for part in tl.static_range(2):
        v = tl.load(v_base + part * HALF, mask=kmask, other=0.0)
        tl.store(vc_base + part * HALF, v.to(vc_ptr.dtype.element_ty), mask=kmask)
