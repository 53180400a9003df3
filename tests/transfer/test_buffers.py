"""Zero-copy views of block buffers (bf16 through uint8) and the one gather copy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvmesh.engine.transfer.buffers import KVBlock, as_bytes
from kvmesh.engine.transfer.header import BlockHeader

from tests.support.kv_blocks import blocks, chain, layout


def test_as_bytes_is_a_view_for_bf16_and_fp32():
    for dtype in (torch.bfloat16, torch.float32):
        t = torch.randn(4, 3, 8).to(dtype)
        view = as_bytes(t)
        assert view.dtype == np.uint8 and view.nbytes == t.numel() * t.element_size()
        view[:2] = 0  # writes through: same memory
        assert t.view(torch.uint8).reshape(-1)[:2].tolist() == [0, 0]


def test_as_bytes_refuses_copies():
    with pytest.raises(ValueError, match="contiguous"):
        as_bytes(torch.randn(4, 4).t())
    with pytest.raises(ValueError, match="contiguous"):
        as_bytes(np.zeros((4, 4))[:, ::2])
    with pytest.raises(TypeError):
        as_bytes([1, 2, 3])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gather_then_views_round_trip(dtype):
    lay = layout(dtype)
    (blk,), (src,) = blocks(lay, 1)
    for name, t in src.items():
        assert torch.equal(blk.tensor(name), t)
    views = blk.buffers()
    assert list(views) == [b.name for b in lay.buffers]
    assert all(np.shares_memory(v, blk.data) for v in views.values())


def test_block_size_and_missing_buffers_checked():
    lay = layout()
    hdr = BlockHeader(lay, chain(lay, 1)[0], None)
    with pytest.raises(ValueError, match="bytes"):
        KVBlock(hdr, np.zeros(lay.nbytes - 1, np.uint8))
    with pytest.raises(KeyError, match="missing"):
        KVBlock.from_buffers(hdr, {"k.0": torch.zeros(lay.block_size, 3, 8, dtype=torch.bfloat16)})
    staging = torch.empty(lay.nbytes, dtype=torch.uint8)
    (blk,), _ = blocks(lay, 1)
    again = KVBlock.from_buffers(hdr, blk.buffers(), out=staging)
    assert np.shares_memory(again.data, staging.numpy())
    assert np.array_equal(again.data, blk.data)
