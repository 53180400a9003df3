"""The native CPU decode kernel against the fp64 naive oracle and the torch reference."""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine.kernels.cpu_native import native_available, paged_decode_attention_cpu
from kvmesh.engine.kernels.decode_attention import paged_decode_attention_ref

from ._helpers import PagedBatch, make_paged_batch, naive_decode

pytestmark = pytest.mark.skipif(not native_available(), reason="no C compiler to build the native kernel")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (9, 3), (16, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [1, 16])
def test_matches_oracle(dtype, tol, hq, hkv, head_dim, block_size):
    g = torch.Generator().manual_seed(hq * 1000 + head_dim + block_size)
    lens = [1, 15, 16, 17, 40, 130]
    batch = make_paged_batch(lens, hkv, head_dim, block_size, dtype, g)
    q = torch.randn(len(lens), hq, head_dim, generator=g).to(dtype)
    scale = head_dim ** -0.5
    got = paged_decode_attention_cpu(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, scale)
    want = naive_decode(q, batch, scale)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    ref = paged_decode_attention_ref(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, scale)
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


def test_cache_views_and_fallback():
    g = torch.Generator().manual_seed(7)
    big = torch.randn(2, 3, 12, 16, 3, 64, generator=g)  # [layers, K/V, blocks, bs, heads, dim]
    k, v = big[1, 0], big[1, 1]
    bt = torch.tensor([[3, 5, 7], [0, 1, 2]], dtype=torch.int32)
    lens = torch.tensor([40, 17], dtype=torch.int32)
    q = torch.randn(2, 9, 64, generator=g)
    want = naive_decode(q, PagedBatch(k, v, bt, lens), 0.125)
    torch.testing.assert_close(paged_decode_attention_cpu(q, k, v, bt, lens, 0.125).double(), want.double(),
                               atol=2e-5, rtol=2e-5)
    # fp16 is not covered natively: the call falls back to the reference and still answers.
    got16 = paged_decode_attention_cpu(q.half(), k.half(), v.half(), bt, lens, 0.125)
    torch.testing.assert_close(got16.float(), want.float(), atol=5e-3, rtol=5e-3)
