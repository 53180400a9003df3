"""Paged attention for prefill and extend: several new query tokens per sequence, causal.

Shapes: q ``[T, Hq, D]`` flat over sequences; ``query_start_loc`` int32 ``[S+1]`` cumulative
query lengths; ``seq_lens`` int32 ``[S]`` total context per sequence including the new tokens
(whose K/V are already in the cache). Sequence i's new tokens sit at absolute positions
``seq_lens[i] - q_len_i .. seq_lens[i] - 1`` and token p attends to cached positions ``0..p``.
Invariant: ``1 <= q_len_i <= seq_lens[i]`` for every sequence with q_len_i > 0; sequences with
q_len_i == 0 contribute no rows. The output has q's shape and dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._common import (
    check_gqa,
    check_kv_cache,
    check_triton_launch,
    dot_precision,
    next_power_of_2,
    require_last_dim_contiguous,
    triton_dot_dtype,
)


def _check_extend_inputs(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens) -> tuple[int, int, int]:
    _, bs, hkv, d = check_kv_cache(k_cache, v_cache)
    if q.dim() != 3 or q.shape[2] != d:
        raise ValueError(f"q must be [T, Hq, {d}], got {tuple(q.shape)}")
    s = seq_lens.shape[0]
    if seq_lens.dim() != 1 or query_start_loc.shape != (s + 1,):
        raise ValueError(
            f"query_start_loc must be [num_seqs + 1] = [{s + 1}], got {tuple(query_start_loc.shape)}"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != s:
        raise ValueError(f"block_tables must be [{s}, max_blocks], got {tuple(block_tables.shape)}")
    g = check_gqa(q.shape[1], hkv)
    return bs, hkv, g


def _causal_visible(q_len: int, ctx_len: int, device: torch.device) -> torch.Tensor:
    """Bool ``[q_len, ctx_len]``: query row i (absolute position ctx_len - q_len + i) sees keys <= it."""
    rows = torch.arange(ctx_len - q_len, ctx_len, device=device)
    cols = torch.arange(ctx_len, device=device)
    return cols[None, :] <= rows[:, None]


def paged_extend_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Torch paged extend attention (the production CPU path): one SDPA call per sequence.

    Each sequence's context is gathered block by block and attended with SDPA's grouped-query
    mode (kv heads are not repeated in memory). A plain prefill (q_len == seq_len) uses SDPA's
    built-in causal mask; a chunk after a prefix gets an explicit mask aligned to the end of
    the context. ``max_query_len`` is accepted for parity with the Triton version and unused.
    """
    bs, hkv, g = _check_extend_inputs(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens)
    del max_query_len
    d = q.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, ctx_len in enumerate(lens):
        q0, q1 = starts[i], starts[i + 1]
        q_len = q1 - q0
        if q_len == 0:
            continue
        if not 0 < q_len <= ctx_len:
            raise ValueError(f"sequence {i} has {q_len} new tokens but a context of only {ctx_len}")
        nb = -(-ctx_len // bs)
        if nb > block_tables.shape[1]:
            raise ValueError(
                f"sequence {i} of {ctx_len} tokens needs {nb} blocks but block_tables has {block_tables.shape[1]}"
            )
        idx = block_tables[i, :nb].long()
        keys = k_cache.index_select(0, idx).view(nb * bs, hkv, d)[:ctx_len].transpose(0, 1)
        values = v_cache.index_select(0, idx).view(nb * bs, hkv, d)[:ctx_len].transpose(0, 1)
        if q_len == ctx_len:
            mask, causal = None, True
        else:
            mask, causal = _causal_visible(q_len, ctx_len, q.device), False
        o = F.scaled_dot_product_attention(
            q[q0:q1].transpose(0, 1),  # [Hq, q_len, D]
            keys.to(q.dtype),
            values.to(q.dtype),
            attn_mask=mask,
            is_causal=causal,
            scale=scale,
            enable_gqa=g > 1,
        )
        out[q0:q1] = o.transpose(0, 1)
    return out


def paged_extend_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Triton paged extend attention: programs over (seq, kv_head, query tile).

    A tile holds the G query heads of one kv head for BLOCK_M // G consecutive query tokens, so
    each K/V tile read through the block table serves the whole group; keys are masked causally
    by absolute position, with an online softmax. ``max_query_len`` (optional, the largest
    q_len) sizes the grid without reading query_start_loc back from the device.
    """
    bs, hkv, g = _check_extend_inputs(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens)
    check_triton_launch(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        require_last_dim_contiguous(name, t)
    from ._extend_kernel import extend_attention_kernel

    d = q.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_seqs = seq_lens.shape[0]
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_query_len <= 0:
        return out
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    block_m = max(64, next_power_of_2(g))
    tokens_per_tile = block_m // g
    dot_dtype = triton_dot_dtype(q.dtype)
    grid = (num_seqs, hkv, -(-max_query_len // tokens_per_tile))
    extend_attention_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        float(scale),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        bs, g, d,
        BLOCK_M=block_m,
        BLOCK_N=64 if d <= 128 else 32,
        BLOCK_D=max(16, next_power_of_2(d)),
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=dot_precision(dot_dtype),
        num_warps=4,
    )
    return out
