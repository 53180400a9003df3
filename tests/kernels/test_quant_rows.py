"""Weights kept block-quantized (Q4_1 / Q8_0) and multiplied from their blocks.

Real: gguf's own quantizer and reference dequantizer make the blocks and the fp32 weights the
kernel must reproduce bit for bit (and torch's rounding the bf16 weights); the native library is
the real one (the build for this CPU and the portable build, which has no AVX512F and must
decline so the dense path answers). The bf16 product runs on AMX tiles: on a CPU without them
these tests check that it declines."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from kvmesh.engine.dtype_choice import cpu_flags
from kvmesh.engine.kernels import quant_rows
from kvmesh.engine.kernels.cpu_native import native_available
from kvmesh.engine.kernels.quant_rows import QuantRows
from kvmesh.engine.model.gguf_loader import unpermute_qk
from kvmesh.engine.model.linear import QUANT_MAX_ROWS, LinearFactory

pytestmark = [pytest.mark.skipif(not native_available(), reason="no C compiler to build the native kernel"),
              pytest.mark.usefixtures("kernel_build")]


def _avx512f(build: str) -> bool:
    return build == "native" and "avx512f" in cpu_flags()


def _amx(build: str) -> bool:
    return build == "native" and {"amx_bf16", "amx_tile", "avx512_bf16"} <= cpu_flags()


def _blocks(rows: int, cols: int, qtype: GGMLQuantizationType, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """(raw GGUF blocks [rows, row bytes], the fp32 matrix gguf dequantizes them to)."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    raw = gguf_quantize(w, qtype)
    return raw, torch.from_numpy(np.ascontiguousarray(gguf_dequantize(raw, qtype)))


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0])
def test_blocks_dequantize_to_ggufs_weights_and_multiply_like_linear(qtype, kernel_build):
    raw, w = _blocks(48, 192, qtype, seed=int(qtype))
    q = QuantRows.from_gguf(raw, qtype.name)
    assert q is not None and (q.rows, q.cols) == (48, 192)
    got = quant_rows.dequantize(q)
    if not _avx512f(kernel_build):
        assert got is None and quant_rows.qlinear(torch.randn(2, 192), q) is None
        return
    assert torch.equal(got, w)  # bit for bit, no fused multiply-add
    g = torch.Generator().manual_seed(1)
    for m in (1, 3, 8, 16, 17, 40):  # each accumulator width, and more rows than one pass holds
        x = torch.randn(m, 192, generator=g)
        torch.testing.assert_close(quant_rows.qlinear(x, q), F.linear(x, w), atol=2e-5, rtol=2e-5)
    strided = torch.randn(4, 400, generator=g)[:, 8:200]  # rows further apart than cols
    torch.testing.assert_close(quant_rows.qlinear(strided, q), F.linear(strided, w), atol=2e-5, rtol=2e-5)
    assert quant_rows.qlinear(torch.randn(2, 160), q) is None  # wrong width: the caller's dense path
    assert quant_rows.qlinear(torch.randn(2, 192).double(), q) is None


def test_rows_taken_and_stacked_as_their_matrices(kernel_build):
    raw_a, wa = _blocks(16, 64, GGMLQuantizationType.Q4_1, seed=3)
    raw_b, wb = _blocks(8, 64, GGMLQuantizationType.Q4_1, seed=4)
    a, b = QuantRows.from_gguf(raw_a, "Q4_1"), QuantRows.from_gguf(raw_b, "Q4_1")
    perm = unpermute_qk(torch.arange(16), 2)  # how the loader reorders a GGUF's Q/K rows
    both = QuantRows.cat([a.take(perm), b])
    assert both is not None and both.rows == 24
    if _avx512f(kernel_build):
        assert torch.equal(quant_rows.dequantize(both), torch.cat([unpermute_qk(wa, 2), wb]))
    raw_c, _ = _blocks(8, 64, GGMLQuantizationType.Q8_0, seed=5)
    assert QuantRows.cat([a, QuantRows.from_gguf(raw_c, "Q8_0")]) is None  # kinds differ
    assert QuantRows.from_gguf(np.zeros((4, 64), np.float32), "F32") is None
    assert QuantRows.from_gguf(np.zeros((4, 30), np.uint8), "Q4_1") is None  # not whole blocks


def test_linear_takes_blocks_for_small_batches_only_when_exact(kernel_build):
    raw, w = _blocks(32, 128, GGMLQuantizationType.Q4_1, seed=6)
    q = QuantRows.from_gguf(raw, "Q4_1")
    bias = torch.randn(32)
    factory = LinearFactory(torch.device("cpu"), torch.float32)
    fn = factory(w, bias, quant=q)
    rows = QUANT_MAX_ROWS[torch.float32]
    small, large = torch.randn(rows, 128), torch.randn(rows + 1, 128)
    torch.testing.assert_close(fn(small), F.linear(small, w, bias), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(fn(large), F.linear(large, w, bias), atol=2e-5, rtol=2e-5)
    assert factory.quantized_bytes == (q.nbytes if _avx512f(kernel_build) else 0)
    # Blocks that do not dequantize to the weight exactly are never used.
    other = LinearFactory(torch.device("cpu"), torch.float32)
    nudged = w.clone()
    nudged[3, 5] = torch.nextafter(nudged[3, 5], torch.tensor(1.0))
    other(nudged, quant=q)
    assert other.quantized_bytes == 0


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0])
def test_bf16_blocks_round_like_torch_and_multiply_on_tiles(qtype, kernel_build):
    raw, w = _blocks(48, 192, qtype, seed=10 + int(qtype))
    wb = w.to(torch.bfloat16)  # the weight a bf16 model loads
    q = QuantRows.from_gguf(raw, qtype.name)
    got = quant_rows.dequantize(q, torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    if not _amx(kernel_build):
        assert quant_rows.qlinear(torch.randn(2, 192, generator=g).bfloat16(), q) is None
        return
    assert torch.equal(got, wb)
    for m in (1, 5, 16, 17, 33, 64):  # one to four accumulator tiles, partly filled
        x = torch.randn(m, 192, generator=g).bfloat16()
        want = F.linear(x.double(), wb.double())  # exact sums of the same bf16 products
        torch.testing.assert_close(quant_rows.qlinear(x, q).double(), want, atol=2e-2, rtol=1e-2)
    strided = torch.randn(4, 400, generator=g).bfloat16()[:, 8:200]
    torch.testing.assert_close(quant_rows.qlinear(strided, q).double(),
                               F.linear(strided.double(), wb.double()), atol=2e-2, rtol=1e-2)
    assert quant_rows.qlinear(torch.randn(65, 192).bfloat16(), q) is None  # more rows than four tiles
    assert quant_rows.qlinear(torch.randn(2, 160).bfloat16(), q) is None
    odd = QuantRows.from_gguf(_blocks(40, 192, qtype, seed=3)[0], qtype.name)
    assert quant_rows.qlinear(torch.randn(2, 192).bfloat16(), odd) is None  # outputs not a multiple of 16


def test_bf16_linear_takes_blocks_on_tiles_and_leaves_torchs_tiles_as_they_were(kernel_build):
    """oneDNN's bf16 matmuls run on the same tile registers on AMX CPUs: a product from blocks
    between two of them changes neither's answer."""
    raw, w = _blocks(64, 256, GGMLQuantizationType.Q4_1, seed=7)
    wb = w.to(torch.bfloat16)
    q = QuantRows.from_gguf(raw, "Q4_1")
    factory = LinearFactory(torch.device("cpu"), torch.bfloat16)
    fn = factory(wb, quant=q)
    assert factory.quantized_bytes == (q.nbytes if _amx(kernel_build) else 0)
    rows = QUANT_MAX_ROWS[torch.bfloat16]
    g = torch.Generator().manual_seed(3)
    big = torch.randn(512, 256, generator=g).bfloat16()
    before = F.linear(big, wb)
    for m in (1, rows, rows + 1):
        x = torch.randn(m, 256, generator=g).bfloat16()
        torch.testing.assert_close(fn(x).double(), F.linear(x.double(), wb.double()), atol=3e-2, rtol=1e-2)
        assert torch.equal(F.linear(big, wb), before)
    nudged = wb.clone()
    nudged[3, 5] += 1.0
    other = LinearFactory(torch.device("cpu"), torch.bfloat16)
    other(nudged, quant=q)
    assert other.quantized_bytes == 0


def test_a_bound_product_keeps_its_blocks_alive(kernel_build):
    """The model binds each weight's product once (its blocks stacked into new tensors, then
    dropped by the caller): the bound product must still read them."""
    raw, w = _blocks(512, 1024, GGMLQuantizationType.Q8_0, seed=8)
    q = QuantRows.from_gguf(raw, "Q8_0")
    fn = quant_rows.product(QuantRows.cat([q, q]))
    if not _avx512f(kernel_build):
        assert fn is None or fn(torch.randn(2, 1024)) is None
        return
    del q
    gc.collect()
    junk = [torch.full((512, 1024), 7.0) for _ in range(8)]  # reuse what a dangling address would read
    x = torch.randn(3, 1024)
    torch.testing.assert_close(fn(x), F.linear(x, torch.cat([w, w])), atol=2e-5, rtol=2e-5)
    del junk
