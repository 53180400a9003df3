"""Paged attention for decode: one query token per sequence against its cached context.

Shapes: q ``[B, Hq, D]``; caches ``[num_blocks, block_size, Hkv, D]``; ``block_tables`` int32
``[B, max_blocks_per_seq]``; ``seq_lens`` int32 ``[B]`` (context length including this step's
token, whose K/V are already in the cache; must be >= 1). Query head ``h`` reads kv head
``h // (Hq // Hkv)``. The output has q's shape and dtype.
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

# Splits are sized so that each program still streams a useful amount of KV: below this many
# tokens per split, the extra reduce pass costs more than the parallelism gains.
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64
DEFAULT_NUM_SMS = 132  # H100/H200; used when no CUDA device can be queried
# The torch path gathers K/V for this many bytes' worth of sequences at a time: small enough
# to stay in a CPU's L2/L3 between the gather and SDPA, large enough to amortise op overhead.
REF_CHUNK_BYTES = 4 << 20


def _check_decode_inputs(q, k_cache, v_cache, block_tables, seq_lens) -> tuple[int, int, int, int]:
    _, bs, hkv, d = check_kv_cache(k_cache, v_cache)
    if q.dim() != 3 or q.shape[2] != d:
        raise ValueError(f"q must be [B, Hq, {d}], got {tuple(q.shape)}")
    b = q.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != b or seq_lens.shape != (b,):
        raise ValueError(
            f"block_tables must be [{b}, max_blocks] and seq_lens [{b}]; got "
            f"{tuple(block_tables.shape)} and {tuple(seq_lens.shape)}"
        )
    g = check_gqa(q.shape[1], hkv)
    return b, bs, hkv, g


def _context_slots_capacity(block_tables: torch.Tensor, block_size: int, max_seq_len: int) -> int:
    """Number of blocks covering max_seq_len; raises if the table is too narrow."""
    nb = -(-max_seq_len // block_size)
    if nb > block_tables.shape[1]:
        raise ValueError(
            f"a sequence of {max_seq_len} tokens needs {nb} blocks of {block_size}, "
            f"but block_tables has only {block_tables.shape[1]} columns"
        )
    return nb


def gather_context(cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``[B, num_blocks * block_size, H, D]``: each sequence's first ``num_blocks`` blocks, in order.

    Gathers whole blocks (one contiguous run of block_size * H * D elements each) rather than
    single tokens, which is several times faster than a per-slot gather on CPU.
    """
    b = block_tables.shape[0]
    _, bs, h, d = cache.shape
    idx = block_tables[:, :num_blocks].reshape(-1).long()
    return cache.index_select(0, idx).view(b, num_blocks * bs, h, d)


def _decode_rows(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_blocks: int,
) -> torch.Tensor:
    """Decode attention for a group of sequences whose contexts fit in ``num_blocks`` blocks."""
    b, hq, d = q.shape
    hkv = k_cache.shape[2]
    length = num_blocks * k_cache.shape[1]
    keys = gather_context(k_cache, block_tables, num_blocks)  # [b, L, Hkv, D], a fresh copy
    values = gather_context(v_cache, block_tables, num_blocks)
    positions = torch.arange(length, device=q.device)
    hidden = positions[None, :] >= seq_lens[:, None].to(positions.dtype)  # [b, L]
    # Slots past a sequence's end may hold anything (uninitialised memory, NaN): masking the
    # scores is not enough, since 0 * NaN = NaN in p @ V. Zero just those rows of the copy.
    rows = hidden.nonzero(as_tuple=True)
    keys[rows] = 0
    values[rows] = 0
    out = F.scaled_dot_product_attention(
        q.reshape(b, hkv, hq // hkv, d),
        keys.transpose(1, 2).to(q.dtype),
        values.transpose(1, 2).to(q.dtype),
        attn_mask=~hidden.view(b, 1, 1, length),
        scale=scale,
    )
    return out.reshape(b, hq, d)


def decode_chunk_rows(length: int, row_bytes: int, budget: int | None = None) -> int:
    """Sequences per chunk so that one chunk's gathered K and V (``length`` tokens of
    ``row_bytes`` each, twice) stay within ``budget`` bytes (default REF_CHUNK_BYTES); >= 1."""
    budget = REF_CHUNK_BYTES if budget is None else budget
    return max(1, budget // max(1, 2 * length * row_bytes))


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Torch paged decode attention (the production CPU path).

    ``max_seq_len`` (optional) is ``int(seq_lens.max())``; pass it to avoid reading seq_lens
    back from the device.

    Method: per chunk of sequences, gather their blocks once, mask positions >= seq_len, and
    run SDPA with the G query heads of a kv head laid out as G query rows of that head, so
    kv heads are never repeated in memory. With one CPU thread, chunks are sized
    (REF_CHUNK_BYTES) so the gathered copy is still in cache when SDPA reads it, which saves
    about a third of the time for a large batch.
    Cache slots at positions >= seq_len never affect the result, whatever they hold.
    """
    b, bs, hkv, _ = _check_decode_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    d = q.shape[2]
    if b == 0:
        return torch.empty_like(q)
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    nb = _context_slots_capacity(block_tables, bs, max_seq_len)
    rows = decode_chunk_rows(nb * bs, hkv * d * k_cache.element_size())
    # Chunking pays off on a CPU (cache locality) but multiplies the number of torch ops. With
    # several intra-op threads every op is a thread hand-off, which on a busy machine can cost
    # a scheduler slice each (measured: 10x slower on 2 oversubscribed cores), so chunk only
    # when torch runs single-threaded.
    single_cpu_thread = q.device.type == "cpu" and torch.get_num_threads() == 1
    if rows >= b or not single_cpu_thread:
        return _decode_rows(q, k_cache, v_cache, block_tables, seq_lens, scale, nb)
    lens = seq_lens.tolist()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for s in range(0, b, rows):
        e = min(s + rows, b)
        # Each chunk only gathers as many blocks as its own longest sequence needs.
        chunk_nb = -(-max(lens[s:e]) // bs)
        out[s:e] = _decode_rows(q[s:e], k_cache, v_cache, block_tables[s:e], seq_lens[s:e], scale, chunk_nb)
    return out


def choose_num_splits(
    batch: int,
    num_kv_heads: int,
    max_seq_len: int,
    num_sms: int = DEFAULT_NUM_SMS,
) -> int:
    """Split-K factor for flash-decoding.

    Enough (seq, kv_head, split) programs to give every SM about two, but never splits shorter
    than MIN_TOKENS_PER_SPLIT tokens and never more than MAX_SPLITS. Always >= 1.
    """
    base = max(1, batch * num_kv_heads)
    by_length = -(-max(1, max_seq_len) // MIN_TOKENS_PER_SPLIT)
    by_occupancy = -(-2 * num_sms // base)
    return max(1, min(by_length, by_occupancy, MAX_SPLITS))


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_NUM_SMS


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    *,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Triton flash-decoding: programs over (seq, kv_head, split), then a log-sum-exp reduce.

    Each program loads the G query heads sharing its kv head together, streams its share of the
    sequence's tokens through the block table with an online softmax, and writes a partial
    output plus its log-sum-exp; with a single split the first kernel writes the output directly.
    ``num_splits=None`` picks :func:`choose_num_splits` from the batch and context length.
    """
    b, bs, hkv, g = _check_decode_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    check_triton_launch(q, k_cache, v_cache, block_tables, seq_lens)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        require_last_dim_contiguous(name, t)
    from ._decode_kernel import decode_reduce_kernel, decode_split_kernel

    d = q.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        num_splits = choose_num_splits(b, hkv, max_seq_len, _num_sms(q.device))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    block_d = max(16, next_power_of_2(d))
    direct = num_splits == 1
    if direct:
        part, lse = out.unsqueeze(2), out  # lse is never touched when DIRECT
        lse_strides = (0, 0, 0)
    else:
        part = torch.empty((b, q.shape[1], num_splits, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((b, q.shape[1], num_splits), dtype=torch.float32, device=q.device)
        lse_strides = lse.stride()
    dot_dtype = triton_dot_dtype(q.dtype)
    decode_split_kernel[(b, hkv, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part, lse,
        float(scale),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        part.stride(0), part.stride(1), part.stride(2),
        lse_strides[0], lse_strides[1], lse_strides[2],
        bs, g, d, num_splits,
        BLOCK_H=max(16, next_power_of_2(g)),
        BLOCK_N=64 if d <= 128 else 32,
        BLOCK_D=block_d,
        DIRECT=direct,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=dot_precision(dot_dtype),
        num_warps=4,
    )
    if not direct:
        decode_reduce_kernel[(b, q.shape[1])](
            part, lse, out,
            part.stride(0), part.stride(1), part.stride(2),
            lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            num_splits, d,
            BLOCK_S=next_power_of_2(num_splits),
            BLOCK_D=block_d,
        )
    return out
