"""The one gather out of and the one scatter into the paged KV cache, against per-block slicing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvmesh.engine.kv.gather import block_shape, gather_blocks, id_runs, scatter_blocks
from kvmesh.engine.kv.remote_tier import one_buffer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gather_is_each_blocks_layers_in_wire_order_and_scatter_inverts_it(dtype):
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(3, 2, 10, 4, 2, 8, generator=gen).to(dtype)  # [layers, 2, blocks, bs, heads, dim]
    ids = [7, 2, 9, 0]
    out = gather_blocks(kv, ids)
    assert out.shape == (4, *block_shape(kv)) and out.is_contiguous()
    for i, b in enumerate(ids):
        assert torch.equal(out[i], kv[:, :, b])
    fresh = torch.zeros_like(kv)
    scatter_blocks(fresh, [1, 3, 5, 8], out)
    for i, b in enumerate([1, 3, 5, 8]):
        assert torch.equal(fresh[:, :, b], kv[:, :, ids[i]])
    assert int((fresh != 0).any(dim=(0, 1, 3, 4, 5)).sum()) == 4  # nothing else written


@pytest.mark.parametrize("ids", [
    list(range(3, 19)),  # one run: slice copies
    [*range(0, 8), *range(20, 28)],  # two runs
    [*range(30, 39), 1, 2, *range(10, 15)],  # runs out of order
    [5, 2, 9, 14, 0, 31, 17, 8, 22, 27, 11, 3, 35, 6, 19, 25],  # scattered: the indexed copy
])
def test_scatter_writes_exactly_the_listed_blocks_whatever_their_runs(ids):
    gen = torch.Generator().manual_seed(1)
    data = torch.randn(len(ids), 2, 2, 4, 2, 8, generator=gen)
    kv = torch.zeros(2, 2, 40, 4, 2, 8)
    scatter_blocks(kv, ids, data)
    for i, b in enumerate(ids):
        assert torch.equal(kv[:, :, b], data[i])
    assert int((kv != 0).any(dim=(0, 1, 3, 4, 5)).sum()) == len(ids)


def test_id_runs_cover_the_ids_in_order():
    assert id_runs([4, 5, 6, 1, 2, 9]) == [(4, 0, 3), (1, 3, 2), (9, 5, 1)]
    assert id_runs([]) == []


def test_one_buffer_is_a_view_for_back_to_back_payloads_and_a_copy_otherwise():
    buf = np.arange(40, dtype=np.uint8)
    views = [buf[i * 8:(i + 1) * 8] for i in range(1, 4)]
    flat = one_buffer(views)
    assert np.shares_memory(flat, buf) and np.array_equal(flat, buf[8:32])
    apart = [np.arange(8, dtype=np.uint8), np.arange(8, 16, dtype=np.uint8)]
    joined = one_buffer(apart)
    assert np.array_equal(joined, np.arange(16, dtype=np.uint8))
    gap = [buf[0:8], buf[16:24]]
    assert np.array_equal(one_buffer(gap), np.concatenate(gap)) and not np.shares_memory(one_buffer(gap), buf)
