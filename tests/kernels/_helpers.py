"""Shared builders and naive oracles for the kernel tests.

The naive attention gathers one token at a time through the block table and runs a dense
softmax in fp64, so it shares no code path with the references or the Triton kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedBatch:
    """A random paged KV cache holding ``seq_lens[i]`` tokens for each sequence i.

    Blocks are handed out in a random order (so sequences are scattered through the cache)
    and a few spare blocks stay unused; block_tables are padded with 0, a valid index.
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor


def make_paged_batch(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    generator: torch.Generator,
    spare_blocks: int = 3,
) -> PagedBatch:
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    width = max(1, max(blocks_per_seq) + 1)  # one extra padded column
    total = sum(blocks_per_seq) + spare_blocks
    shape = (total, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    order = torch.randperm(total, generator=generator)
    tables = torch.zeros((len(seq_lens), width), dtype=torch.int32)
    used = 0
    for i, nb in enumerate(blocks_per_seq):
        tables[i, :nb] = order[used : used + nb].to(torch.int32)
        used += nb
    return PagedBatch(k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32))


def token_kv(batch: PagedBatch, seq: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[length, Hkv, D]`` of one sequence, gathered token by token in fp64."""
    bs = batch.k_cache.shape[1]
    keys, values = [], []
    for pos in range(length):
        block = int(batch.block_tables[seq, pos // bs])
        keys.append(batch.k_cache[block, pos % bs])
        values.append(batch.v_cache[block, pos % bs])
    return torch.stack(keys).double(), torch.stack(values).double()


def naive_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: list[int], scale: float
) -> torch.Tensor:
    """Dense attention in fp64: q ``[n, Hq, D]`` at absolute ``positions`` sees keys ``0..pos``."""
    g = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(g, dim=1)
    v = values.repeat_interleave(g, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    key_pos = torch.arange(keys.shape[0])
    hidden = key_pos[None, :] > torch.tensor(positions)[:, None]
    scores = scores.masked_fill(hidden[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


def naive_decode(q: torch.Tensor, batch: PagedBatch, scale: float) -> torch.Tensor:
    out = []
    for i, n in enumerate(batch.seq_lens.tolist()):
        keys, values = token_kv(batch, i, n)
        out.append(naive_attention(q[i : i + 1], keys, values, [n - 1], scale)[0])
    return torch.stack(out)


def naive_extend(q: torch.Tensor, batch: PagedBatch, query_start_loc: torch.Tensor, scale: float) -> torch.Tensor:
    out = torch.zeros(q.shape, dtype=torch.float64)
    starts = query_start_loc.tolist()
    for i, n in enumerate(batch.seq_lens.tolist()):
        a, b = starts[i], starts[i + 1]
        if a == b:
            continue
        keys, values = token_kv(batch, i, n)
        out[a:b] = naive_attention(q[a:b], keys, values, list(range(n - (b - a), n)), scale)
    return out


def ulp_tolerance(dtype: torch.dtype) -> dict[str, float]:
    """Tolerances for Triton vs reference comparisons.

    bf16 allows a couple of units in the last place: the kernels round once at the end where
    torch rounds after each op, and the Triton interpreter truncates instead of rounding to
    nearest when it converts fp32 to bf16.
    """
    if dtype == torch.float32:
        return {"atol": 2e-5, "rtol": 2e-5}
    if dtype == torch.bfloat16:
        return {"atol": 3e-2, "rtol": 2e-2}
    return {"atol": 2e-3, "rtol": 2e-3}
