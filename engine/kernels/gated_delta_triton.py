"""Triton versions of the gated delta rule's chunked scan (prefill) and recurrent step (decode).

Same signatures, shapes and contracts as :func:`gated_delta.chunked` and
:func:`gated_delta.recurrent_step`, which stay the reference and the CPU path: fp32 inputs
(q L2-normalised and scaled, k L2-normalised, grouped heads expanded), a state [B, H, Dk, Dv]
that is read and never written, right-padded batches (a zero-padded position leaves the state
unchanged), and ``capture`` (sequence, tokens) pairs answered with the state after that many
tokens, computed inside the scan from the state at the chunk's start.

Chunks are 16 tokens (``KERNEL_CHUNK``, for register pressure; the reference uses 64). The
math does not depend on the chunk size, and results equal the reference up to fp32 rounding
(the triangular inverse is formed by forward substitution instead of a LAPACK solve, sums run
in another order).
"""

from __future__ import annotations

import torch

from ._common import check_triton_launch, next_power_of_2, require_last_dim_contiguous


# Chunk size and launch options, shared with the sm_90 compile check. fp32 products with IEEE
# rounding (no TF32) keep agreement with the fp32 reference; Triton lowers them to FMA loops whose
# operands live in registers, so at Dk = Dv = 128 the tile sizes are bounded by spills, read from
# the sm_90 cubins (cuobjdump --dump-resource-usage, stack bytes per thread): the prep kernel
# spills 24 KiB at 64-token chunks, 1 KiB at 32 and nothing at 16; the scan 14.8 KiB at 64
# (and needs ~266 KiB of shared memory with three pipeline stages, over an H100 block's 227 KiB),
# 7.8 KiB at 32 and 2 KiB at 16 with one stage. Not yet timed on a GPU.
KERNEL_CHUNK = 16
DOT_PRECISION = "ieee"
PREP_LAUNCH = {"num_warps": 4, "num_stages": 1}
SCAN_LAUNCH = {"num_warps": 4, "num_stages": 1}
STEP_LAUNCH = {"num_warps": 4}


def _check_fp32(vectors: dict[str, torch.Tensor], scalars: dict[str, torch.Tensor]) -> None:
    """fp32 everywhere; ``vectors`` (head-dim last) also need a unit last stride, ``scalars``
    (one value per token and head) may have any strides."""
    for name, t in {**vectors, **scalars}.items():
        if t.dtype != torch.float32:
            raise ValueError(f"the gated delta kernels take fp32 inputs (the state accumulates in fp32); "
                             f"{name} is {t.dtype}")
    for name, t in vectors.items():
        require_last_dim_contiguous(name, t)


def value_tile(dk: int, dv: int) -> int:
    """Dv columns per program: the [Dk, BV] fp32 state tile stays in registers."""
    return min(next_power_of_2(max(dv, 16)), 32 if dk > 64 else 64)


def _sorted_captures(capture: list[tuple[int, int]], b: int, t: int, device: torch.device):
    """(tok, row, lo) int32 tensors: rows of ``capture`` sorted by (sequence, tokens), and sequence
    s's entries at ``lo[s] .. lo[s+1]``. Validates each pair as the reference does."""
    for seq, tok in capture:
        if not 1 <= tok <= t:
            raise ValueError(f"capture after {tok} tokens is outside 1..{t}")
        if not 0 <= seq < b:
            raise ValueError(f"capture of sequence {seq} is outside 0..{b - 1}")
    order = sorted(range(len(capture)), key=lambda r: capture[r])
    counts = [0] * (b + 1)
    for seq, _ in capture:
        counts[seq + 1] += 1
    for s in range(b):
        counts[s + 1] += counts[s]
    tok = torch.tensor([capture[r][1] for r in order], dtype=torch.int32)
    rows = torch.tensor(order, dtype=torch.int32)
    lo = torch.tensor(counts, dtype=torch.int32)
    return tok.to(device), rows.to(device), lo.to(device)


def chunked_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor, chunk: int = KERNEL_CHUNK,
                   capture: list[tuple[int, int]] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Triton :func:`gated_delta.chunked`: q, k [B, H, T, Dk]; v [B, H, T, Dv]; g, beta [B, H, T];
    state [B, H, Dk, Dv] -> (out [B, H, T, Dv], final state, captured [N, H, Dk, Dv] or None).

    ``chunk`` is the kernels' chunk size (the reference's default is 64; the result does not
    depend on it). Inputs may be strided views (e.g. ``[B, T, H, D].transpose(1, 2)``) with a unit last stride.
    Scratch: u, w and the cumulative decays of every padded position, ``B*H*T*(Dk+Dv+1)`` fp32.
    """
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    if q.shape != k.shape or v.shape[:3] != (b, h, t) or g.shape != (b, h, t) or beta.shape != (b, h, t):
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"g {tuple(g.shape)}, beta {tuple(beta.shape)}")
    if state.shape != (b, h, dk, dv):
        raise ValueError(f"state must be [{b}, {h}, {dk}, {dv}], got {tuple(state.shape)}")
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two >= 16, got {chunk}")
    state = state.float()
    _check_fp32({"q": q, "k": k, "v": v, "state": state}, {"g": g, "beta": beta})
    check_triton_launch(q, k, v, g, beta, state)
    out = torch.empty(b, h, t, dv, dtype=torch.float32, device=v.device)
    captured = torch.empty(len(capture), h, dk, dv, dtype=torch.float32, device=v.device) if capture else None
    caps = _sorted_captures(capture, b, t, v.device) if capture else None
    if t == 0 or b * h == 0:
        return out, state.clone(), captured
    from ._gated_delta_kernel import gd_chunk_prep_kernel, gd_chunk_scan_kernel

    bt = min(chunk, max(16, next_power_of_2(t)))
    n = -(-t // bt)
    bk = max(16, next_power_of_2(dk))
    rows = b * h * n * bt
    u = torch.empty(rows, dv, dtype=torch.float32, device=v.device)
    w = torch.empty(rows, dk, dtype=torch.float32, device=v.device)
    cum = torch.empty(rows, dtype=torch.float32, device=v.device)
    gd_chunk_prep_kernel[(b * h, n)](
        k, v, g, beta, u, w, cum,
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        g.stride(0), g.stride(1), g.stride(2),
        beta.stride(0), beta.stride(1), beta.stride(2),
        h, t, n, dk, dv,
        BT=bt, BK=bk, BDV=max(16, next_power_of_2(dv)), DOT_PRECISION=DOT_PRECISION,
        **PREP_LAUNCH,
    )
    final = torch.empty(b, h, dk, dv, dtype=torch.float32, device=v.device)
    bv = value_tile(dk, dv)
    cap_tok, cap_row, cap_lo = caps if caps else (cum, cum, cum)  # placeholders, never read without captures
    gd_chunk_scan_kernel[(b * h, -(-dv // bv))](
        q, k, u, w, cum, state, out, final,
        cap_tok, cap_row, cap_lo, captured if captured is not None else final,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        state.stride(0), state.stride(1), state.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        h, t, n, dk, dv,
        BT=bt, BK=bk, BV=bv, HAS_CAPTURE=captured is not None, DOT_PRECISION=DOT_PRECISION,
        **SCAN_LAUNCH,
    )
    return out, final, captured


def recurrent_step_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`gated_delta.recurrent_step`: q, k [B, H, Dk]; v [B, H, Dv]; g, beta [B, H];
    state [B, H, Dk, Dv] -> (out [B, H, Dv], new state); ``state`` is not modified."""
    b, h, dk = k.shape
    dv = v.shape[-1]
    if q.shape != k.shape or v.shape[:2] != (b, h) or g.shape != (b, h) or beta.shape != (b, h):
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"g {tuple(g.shape)}, beta {tuple(beta.shape)}")
    if state.shape != (b, h, dk, dv):
        raise ValueError(f"state must be [{b}, {h}, {dk}, {dv}], got {tuple(state.shape)}")
    state = state.float()
    _check_fp32({"q": q, "k": k, "v": v, "state": state}, {"g": g, "beta": beta})
    check_triton_launch(q, k, v, g, beta, state)
    out = torch.empty(b, h, dv, dtype=torch.float32, device=v.device)
    new = torch.empty(b, h, dk, dv, dtype=torch.float32, device=v.device)
    if b * h == 0:
        return out, new
    from ._gated_delta_kernel import gd_recurrent_step_kernel

    bv = value_tile(dk, dv)
    gd_recurrent_step_kernel[(b * h, -(-dv // bv))](
        q, k, v, g, beta, state, out, new,
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1),
        v.stride(0), v.stride(1),
        g.stride(0), g.stride(1),
        beta.stride(0), beta.stride(1),
        state.stride(0), state.stride(1), state.stride(2),
        h, dk, dv,
        BK=max(16, next_power_of_2(dk)), BV=bv,
        **STEP_LAUNCH,
    )
    return out, new
