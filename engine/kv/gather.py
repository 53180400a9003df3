"""Block data between the paged KV cache and the wire: one gather out, one scatter in.

``kv_cache`` is ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``. A block on the wire
is ``[layers, 2, block_size, kv_heads, head_dim]`` contiguous, which is exactly the buffer order
``transfer.header.kv_layout`` names (``k.0, v.0, k.1, ...``), so the same bytes serve the cache
node and the decode engine.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvmesh.engine.transfer.header import BlockLayout, kv_layout


def gather_blocks(kv_cache: torch.Tensor, block_ids: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
    """``[n, layers, 2, block_size, heads, dim]`` contiguous host copy of the listed blocks.

    One indexed copy straight into the wire order: the pool viewed as ``[layers * 2, blocks,
    block bytes]`` is selected along its block axis into the output seen as ``[layers * 2, n,
    block bytes]`` (a transposed view of the contiguous result), so each row moves as one run;
    selecting first and then reordering cost two full copies (2x the time on a 162 MB gather).
    ``out``: a contiguous ``[n, layers, 2, block_size, heads, dim]`` buffer on the cache's device
    to gather into (a reused staging buffer), else a fresh one."""
    layers, two, num_blocks = kv_cache.shape[:3]
    row = kv_cache[0, 0, 0].numel()
    ids = torch.tensor(list(block_ids), dtype=torch.int64, device=kv_cache.device)
    if out is None:
        out = torch.empty((len(ids), *block_shape(kv_cache)), dtype=kv_cache.dtype, device=kv_cache.device)
    torch.index_select(kv_cache.view(layers * two, num_blocks, row), 1, ids,
                       out=out.view(len(ids), layers * two, row).transpose(0, 1))
    return out.cpu()


def scatter_blocks(kv_cache: torch.Tensor, block_ids: Sequence[int], data: torch.Tensor) -> None:
    """Write ``data`` (as ``gather_blocks`` returns it) into the listed blocks.

    Blocks handed out together are consecutive runs (``BlockPool.allocate`` sorts them); a run is
    one strided slice copy, which takes about half an indexed copy's time on CPU. Ids in many
    short runs take the indexed copy (a copy per run would cost more in overhead)."""
    dev = kv_cache.device
    src = data.to(dev, non_blocking=True).movedim(0, 2)
    runs = id_runs(block_ids)
    if len(runs) <= max(1, len(block_ids) // _MIN_RUN):
        for first, pos, n in runs:
            kv_cache[:, :, first:first + n].copy_(src[:, :, pos:pos + n])
        return
    kv_cache.index_copy_(2, torch.tensor(list(block_ids), dtype=torch.int64, device=dev), src)


_MIN_RUN = 8
"""Average run length from which slice copies beat one indexed copy."""


def id_runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(first id, position in block_ids, length)`` of each run of consecutive ids, in order."""
    runs: list[tuple[int, int, int]] = []
    for pos, b in enumerate(block_ids):
        if runs and runs[-1][0] + runs[-1][2] == b:
            first, at, n = runs[-1]
            runs[-1] = (first, at, n + 1)
        else:
            runs.append((b, pos, 1))
    return runs


def block_shape(kv_cache: torch.Tensor) -> tuple[int, ...]:
    """One block's shape on the wire: ``(layers, 2, block_size, heads, dim)``."""
    layers, _, _, bs, heads, dim = kv_cache.shape
    return (layers, 2, bs, heads, dim)


def cache_layout(extra: bytes, kv_cache: torch.Tensor) -> BlockLayout:
    """The wire layout of this KV cache's blocks (what a receiver checks before it takes any)."""
    layers, _, _, bs, heads, dim = kv_cache.shape
    return kv_layout(extra, str(kv_cache.dtype).removeprefix("torch."), bs, layers, heads, dim)
