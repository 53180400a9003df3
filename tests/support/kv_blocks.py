"""Block fixtures shared by the transfer and cache-node tests: real hash chains, random KV bytes."""

from __future__ import annotations

import torch

from kvmesh.engine.block_hash import extra_key, hash_blocks
from kvmesh.engine.transfer.buffers import KVBlock
from kvmesh.engine.transfer.header import BlockHeader, BlockLayout, kv_layout

MODEL = "test-model"


def layout(dtype: str = "bfloat16", block_size: int = 4, layers: int = 2, heads: int = 3, head_dim: int = 8,
           model: str = MODEL) -> BlockLayout:
    return kv_layout(extra_key(model, dtype), dtype, block_size, layers, heads, head_dim)


def chain(lay: BlockLayout, n: int, seed: int = 0) -> list[bytes]:
    tokens = [(seed * 1000 + i) % 50_000 for i in range(n * lay.block_size)]
    return hash_blocks(tokens, lay.block_size, lay.extra_key)


def blocks(lay: BlockLayout, n: int, seed: int = 0) -> tuple[list[KVBlock], list[dict[str, torch.Tensor]]]:
    """``n`` chained blocks with random tensors; also returns the source tensors for comparisons."""
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, lay.dtype)
    out, sources, parent = [], [], None
    for h in chain(lay, n, seed):
        bufs = {b.name: torch.randn(lay.block_size, lay.num_kv_heads, lay.head_dim, generator=gen).to(dtype)
                for b in lay.buffers}
        out.append(KVBlock.from_buffers(BlockHeader(lay, h, parent), bufs))
        sources.append(bufs)
        parent = h
    return out, sources
