"""The native CPU kernels against the fp64 naive oracles and the torch references.

The bf16 elementwise kernels round where torch rounds, so they are compared bit for bit
(RMSNorm within two bf16 steps: its fp32 mean may differ in the last place, which
moves the normalised value by one step before the weight multiplies it).

Every test runs twice: against the library built for this CPU (AVX512-BF16 code where
it has it) and against a portable x86-64-v2 build, the scalar code other CPUs run."""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine.kernels import cpu_native as nat
from kvmesh.engine.kernels.activation import silu_mul_ref
from kvmesh.engine.kernels.cpu_native import native_available, paged_decode_attention_cpu
from kvmesh.engine.kernels.decode_attention import paged_decode_attention_ref
from kvmesh.engine.kernels.extend_attention import paged_extend_attention_ref
from kvmesh.engine.kernels.rmsnorm import rms_norm_ref
from kvmesh.engine.kernels.rope import build_cos_sin_cache, rope_write_kv_ref

from ._helpers import PagedBatch, make_paged_batch, naive_decode, naive_extend

pytestmark = [pytest.mark.skipif(not native_available(), reason="no C compiler to build the native kernel"),
              pytest.mark.usefixtures("kernel_build")]  # tests/kernels/conftest.py: each test on both builds


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


@pytest.mark.parametrize("num_seqs", [3, 20])  # few: one item per kv head; many: whole sequences
def test_decode_bf16_work_splits(num_seqs):
    g = torch.Generator().manual_seed(num_seqs)
    lens = torch.randint(1, 300, (num_seqs,), generator=g).tolist()
    batch = make_paged_batch(lens, 3, 64, 16, torch.bfloat16, g)
    q = torch.randn(num_seqs, 9, 64, generator=g).bfloat16()
    got = paged_decode_attention_cpu(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.125)
    torch.testing.assert_close(got.float(), naive_decode(q, batch, 0.125).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_seqs,threads", [(3, 1), (20, 1), (20, 2)])
def test_decode_prefix_grouping_changes_no_result(dtype, num_seqs, threads):
    """Sequences that share a prefix (their first blocks) interleaved in the batch, as a scheduler
    orders them: running them grouped by prefix gives every sequence the same bits as batch order,
    and both match the oracle (the grouped order is a permutation: none is skipped or repeated)."""
    g = torch.Generator().manual_seed(num_seqs + threads)
    bs, hkv, d, groups, shared = 16, 3, 64, 3, 4  # 3 prefixes of 4 blocks each
    pool = groups * shared + num_seqs * 6
    k = torch.randn(pool, bs, hkv, d, generator=g).to(dtype)
    v = torch.randn(pool, bs, hkv, d, generator=g).to(dtype)
    tails = torch.randperm(pool - groups * shared, generator=g) + groups * shared
    bt = torch.zeros(num_seqs, shared + 2, dtype=torch.int32)
    for i in range(num_seqs):
        grp = i % groups
        bt[i, :shared] = torch.arange(grp * shared, (grp + 1) * shared)
        bt[i, shared:] = tails[2 * i:2 * i + 2]
    lens = torch.randint(shared * bs - 20, (shared + 2) * bs + 1, (num_seqs,), generator=g, dtype=torch.int32)
    q = torch.randn(num_seqs, 9, d, generator=g).to(dtype)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        plain = paged_decode_attention_cpu(q, k, v, bt, lens, 0.125, group_prefixes=False)
        grouped = paged_decode_attention_cpu(q, k, v, bt, lens, 0.125, group_prefixes=True)
    finally:
        torch.set_num_threads(prev)
    assert torch.equal(plain, grouped)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(grouped.float(), naive_decode(q, PagedBatch(k, v, bt, lens), 0.125).float(),
                               atol=tol, rtol=tol)


def _shared_prefix_batch(g, num_seqs, prefixes, prefix_len, hkv, d, bs, tail=(1, 70)):
    """Sequences i opening on prefix i % prefixes (the same blocks), then tails of their own; the
    slots past each tail's last token hold NaN, as a reused block's stale rows may."""
    pb = -(-prefix_len // bs)
    tb = -(-tail[1] // bs) + 1
    pool = prefixes * pb + num_seqs * tb
    k = torch.randn(pool, bs, hkv, d, generator=g).bfloat16()
    v = torch.randn(pool, bs, hkv, d, generator=g).bfloat16()
    tails = torch.randperm(pool - prefixes * pb, generator=g) + prefixes * pb
    bt = torch.zeros(num_seqs, pb + tb, dtype=torch.int32)
    lens = []
    for i in range(num_seqs):
        p = i % prefixes
        bt[i, :pb] = torch.arange(p * pb, (p + 1) * pb)
        bt[i, pb:] = tails[i * tb:(i + 1) * tb]
        lens.append(prefix_len + int(torch.randint(tail[0], tail[1], (1,), generator=g)))
    lens[0] = max(1, prefix_len - 40)  # one member ends inside the prefix: the common part is shorter
    for i, n in enumerate(lens):
        if (n - 1) // bs >= pb:  # a block of its own (in a prefix block, others read on)
            last = int(bt[i, (n - 1) // bs])
            k[last, (n - 1) % bs + 1:] = float("nan")
            v[last, (n - 1) % bs + 1:] = float("nan")
    return k, v, bt, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("hq,hkv,head_dim", [(9, 3, 64), (8, 1, 128), (16, 2, 64), (4, 4, 64), (32, 2, 128)])
@pytest.mark.parametrize("num_seqs,prefixes", [(1, 1), (7, 2), (20, 3), (5, 5)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_bf16_tiles(hq, hkv, head_dim, num_seqs, prefixes, block_size):
    """The AMX kernel (on CPUs with AMX-BF16; elsewhere the call runs the vector kernel) against the
    oracle, on sequences sharing prefixes in subgroups of up to 16 / G, with stale NaN rows in their
    last blocks; grouping by prefix changes no bit, and the vector kernel agrees within bf16."""
    g = torch.Generator().manual_seed(hq * 100 + num_seqs + block_size)
    k, v, bt, lens = _shared_prefix_batch(g, num_seqs, prefixes, 100, hkv, head_dim, block_size)
    q = torch.randn(num_seqs, hq, head_dim, generator=g).bfloat16()
    scale = head_dim ** -0.5
    tiles = paged_decode_attention_cpu(q, k, v, bt, lens, scale)
    alone = paged_decode_attention_cpu(q, k, v, bt, lens, scale, group_prefixes=False)
    vector = paged_decode_attention_cpu(q, k, v, bt, lens, scale, tiles=False)
    assert torch.equal(tiles, alone)
    want = naive_decode(q, PagedBatch(k, v, bt, lens), scale).float()
    torch.testing.assert_close(tiles.float(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(vector.float(), want, atol=2e-2, rtol=2e-2)


def test_decode_bf16_tiles_run_where_the_cpu_has_amx(kernel_build):
    """The AMX entry point answers 0 (it ran) exactly on the native build of a CPU with AMX-BF16,
    and -1 (nothing written) for shapes it does not take: the vector kernel then runs."""
    from kvmesh.engine.dtype_choice import cpu_flags

    lib = nat.load_library()
    g = torch.Generator().manual_seed(3)

    def call(head_dim, block_size):
        batch = make_paged_batch([40, 17], 3, head_dim, block_size, torch.bfloat16, g)
        q = torch.randn(2, 9, head_dim, generator=g).bfloat16()
        out = torch.zeros_like(q)
        sb, ss, sh, _ = batch.k_cache.stride()
        bt = batch.block_tables
        return lib.kvmesh_decode_attention_bf16_amx(
            q.data_ptr(), batch.k_cache.data_ptr(), batch.v_cache.data_ptr(), bt.data_ptr(), bt.stride(0),
            batch.seq_lens.data_ptr(), out.data_ptr(), 2, 9, 3, head_dim, block_size, sb, ss, sh, 0.125, 1, 1)

    amx = kernel_build == "native" and {"amx_bf16", "amx_tile"} <= cpu_flags()
    assert call(64, 16) == (0 if amx else -1)
    assert call(64, 1) == -1  # a 16-token chunk must lie in one block
    assert call(48, 16) == -1


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("hq,hkv,head_dim", [(9, 3, 64), (8, 1, 128), (16, 2, 64), (4, 4, 64)])
@pytest.mark.parametrize("block_size", [1, 16])
def test_extend_matches_oracle(dtype, tol, hq, hkv, head_dim, block_size):
    g = torch.Generator().manual_seed(hq + head_dim + block_size)
    # Plain prefills, chunks after a cached prefix, tiles cut at 16 and single tokens.
    q_lens = [5, 17, 40, 1, 33, 16]
    ctx = [5, 30, 100, 70, 33, 300]
    batch = make_paged_batch(ctx, hkv, head_dim, block_size, dtype, g)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), hq, head_dim, generator=g).to(dtype)
    scale = head_dim ** -0.5
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, qsl, batch.seq_lens, scale)
    got = nat.paged_extend_attention_cpu(*args)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), naive_extend(q, batch, qsl, scale).float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got.float(), paged_extend_attention_ref(*args).float(), atol=tol, rtol=tol)


def test_extend_fp32_runs_natively_where_avx512f_is(kernel_build, monkeypatch):
    """The fp32 call is answered by the C kernel (not the reference it falls back to) where the
    build has AVX512F; the portable build returns -1 and the reference answers."""
    g = torch.Generator().manual_seed(3)
    batch = make_paged_batch([40], 3, 64, 16, torch.float32, g)
    q = torch.randn(8, 9, 64, generator=g)
    qsl = torch.tensor([0, 8], dtype=torch.int32)
    called = []
    monkeypatch.setattr(nat, "paged_extend_attention_ref", lambda *a, **k: called.append(1) or
                        paged_extend_attention_ref(*a, **k))
    got = nat.paged_extend_attention_cpu(q, batch.k_cache, batch.v_cache, batch.block_tables, qsl,
                                         batch.seq_lens, 0.125)
    torch.testing.assert_close(got, naive_extend(q, batch, qsl, 0.125).float(), atol=2e-5, rtol=2e-5)
    native = kernel_build == "native" and "avx512f" in open("/proc/cpuinfo").read()
    assert called == ([] if native else [1])


@pytest.mark.parametrize("flags,sdpa", [({"amx_bf16", "avx512_bf16"}, True), ({"avx512_bf16"}, False),
                                         ({"avx512f"}, False), (set(), False)])
def test_bf16_extend_goes_to_sdpa_only_with_amx(flags, sdpa):
    assert nat.sdpa_beats_native_bf16_extend(frozenset(flags)) is sdpa


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bf16_sdpa_routes_bf16_to_the_reference_and_keeps_fp32_native(kernel_build, monkeypatch, dtype):
    """``bf16_sdpa`` (without tiles): a bf16 call is answered by the torch reference (SDPA); fp32
    stays native where the build has AVX512F; both give the oracle's answer."""
    g = torch.Generator().manual_seed(5)
    batch = make_paged_batch([40, 70], 3, 64, 16, dtype, g)
    q = torch.randn(38, 9, 64, generator=g).to(dtype)
    qsl = torch.tensor([0, 8, 38], dtype=torch.int32)
    called = []
    monkeypatch.setattr(nat, "paged_extend_attention_ref", lambda *a, **k: called.append(1) or
                        paged_extend_attention_ref(*a, **k))
    got = nat.paged_extend_attention_cpu(q, batch.k_cache, batch.v_cache, batch.block_tables, qsl,
                                         batch.seq_lens, 0.125, bf16_sdpa=True, tiles=False)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), naive_extend(q, batch, qsl, 0.125).float(), atol=tol, rtol=tol)
    native_fp32 = kernel_build == "native" and "avx512f" in open("/proc/cpuinfo").read()
    assert called == ([] if dtype == torch.float32 and native_fp32 else [1])


def test_backend_binds_sdpa_for_bf16_extend_from_the_cpu_flags(monkeypatch):
    """The CPU backend reads the flags once: with AMX-BF16 its extend runs bf16 through SDPA."""
    from kvmesh.engine.model import attention

    monkeypatch.setattr(attention, "cpu_flags", lambda: frozenset({"amx_bf16"}))
    assert attention.AttentionBackend("torch")._extend.keywords == {"bf16_sdpa": True}
    monkeypatch.setattr(attention, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    assert attention.AttentionBackend("torch")._extend is nat.paged_extend_attention_cpu


def _stale_tails(batch: PagedBatch) -> PagedBatch:
    """NaN in every cache row past a sequence's length (stale rows of a reused block): a kernel
    that lets a query see them answers NaN."""
    bs = batch.k_cache.shape[1]
    for i, n in enumerate(batch.seq_lens.tolist()):
        last = int(batch.block_tables[i, (n - 1) // bs])
        batch.k_cache[last, (n - 1) % bs + 1:] = float("nan")
        batch.v_cache[last, (n - 1) % bs + 1:] = float("nan")
    return batch


@pytest.mark.parametrize("hq,hkv,head_dim", [(9, 3, 64), (8, 1, 128), (16, 2, 64), (4, 4, 64), (16, 16, 128)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_extend_bf16_tiles(hq, hkv, head_dim, block_size):
    """The AMX kernel (on CPUs with AMX-BF16; elsewhere the call runs the vector kernel) against the
    oracle: plain prefills, chunks after a cached prefix (a long one among them), items cut at
    16 / G tokens and single tokens, stale NaN rows past each context; the AVX-512 kernel agrees
    within bf16."""
    g = torch.Generator().manual_seed(hq * 10 + head_dim + block_size)
    q_lens = [5, 17, 40, 1, 33, 16, 100]
    ctx = [5, 30, 100, 70, 33, 300, 1400]
    batch = _stale_tails(make_paged_batch(ctx, hkv, head_dim, block_size, torch.bfloat16, g))
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), hq, head_dim, generator=g).bfloat16()
    scale = head_dim ** -0.5
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, qsl, batch.seq_lens, scale)
    tiles = nat.paged_extend_attention_cpu(*args)
    vector = nat.paged_extend_attention_cpu(*args, tiles=False)
    want = naive_extend(q, batch, qsl, scale).float()
    torch.testing.assert_close(tiles.float(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(vector.float(), want, atol=2e-2, rtol=2e-2)


def test_extend_bf16_tiles_run_where_the_cpu_has_amx(kernel_build):
    """The AMX entry point answers 0 (it ran) exactly on the native build of a CPU with AMX-BF16,
    -1 (nothing written) for shapes it does not take, and -2 for a chunk longer than its context:
    the wrapper then tries the next kernel, and the reference reports the error."""
    from kvmesh.engine.dtype_choice import cpu_flags

    lib = nat.load_library()
    g = torch.Generator().manual_seed(4)

    def call(head_dim, block_size, q_lens=(8, 3)):
        batch = make_paged_batch([40, 17], 3, head_dim, block_size, torch.bfloat16, g)
        qsl = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32)
        q = torch.randn(sum(q_lens), 9, head_dim, generator=g).bfloat16()
        out = torch.zeros_like(q)
        sb, ss, sh, _ = batch.k_cache.stride()
        bt = batch.block_tables
        return lib.kvmesh_extend_attention_bf16_amx(
            q.data_ptr(), batch.k_cache.data_ptr(), batch.v_cache.data_ptr(), bt.data_ptr(), bt.stride(0),
            bt.shape[1], qsl.data_ptr(), batch.seq_lens.data_ptr(), out.data_ptr(), 2, 9, 3, head_dim, block_size,
            sb, ss, sh, 0.125, 1)

    amx = kernel_build == "native" and {"amx_bf16", "amx_tile"} <= cpu_flags()
    assert call(64, 16) == (0 if amx else -1)
    assert call(64, 1) == -1  # a 16-token chunk must lie in one block
    assert call(96, 16) == -1
    assert call(64, 16, q_lens=(8, 20)) == (-2 if amx else -1)  # 20 new tokens in a context of 17


def test_extend_bad_lengths_raise_like_the_reference():
    g = torch.Generator().manual_seed(1)
    batch = make_paged_batch([10], 1, 64, 16, torch.bfloat16, g)
    q = torch.randn(12, 2, 64, generator=g).bfloat16()
    qsl = torch.tensor([0, 12], dtype=torch.int32)  # 12 new tokens in a context of 10
    with pytest.raises(ValueError, match="new tokens but a context of only"):
        nat.paged_extend_attention_cpu(q, batch.k_cache, batch.v_cache, batch.block_tables, qsl,
                                       batch.seq_lens, 0.125)


@pytest.mark.parametrize("rows,hidden", [(1, 64), (37, 576), (300, 100)])
def test_rms_norm_bf16_matches_reference(rows, hidden):
    g = torch.Generator().manual_seed(rows)
    x = (3 * torch.randn(rows, hidden, generator=g)).bfloat16()
    res = torch.randn(rows, hidden, generator=g).bfloat16()
    w = torch.randn(hidden, generator=g).bfloat16()
    for r in (None, res):
        got, h = nat.rms_norm_cpu(x, w, 1e-5, r)
        want, h_want = rms_norm_ref(x, w, 1e-5, r)
        torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2 ** -6)
        if r is None:
            assert h is None
        else:
            assert torch.equal(h, h_want)
    # A strided view (a column slice of a wider tensor) is read in place.
    wide = torch.randn(rows, hidden + 8, generator=g).bfloat16()
    torch.testing.assert_close(nat.rms_norm_cpu(wide[:, :hidden], w, 1e-6)[0].float(),
                               rms_norm_ref(wide[:, :hidden], w, 1e-6)[0].float(), atol=0, rtol=2 ** -6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("hq,hkv,head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 48)])
def test_rope_write_kv_is_bit_exact(dtype, block_size, hq, hkv, head_dim):
    g = torch.Generator().manual_seed(block_size + hq)
    t = 70
    qkv = torch.randn(t, (hq + 2 * hkv) * head_dim, generator=g).to(dtype)
    q = qkv[:, : hq * head_dim].view(t, hq, head_dim)
    k = qkv[:, hq * head_dim:(hq + hkv) * head_dim].view(t, hkv, head_dim)
    v = qkv[:, (hq + hkv) * head_dim:].view(t, hkv, head_dim)
    cos_sin = build_cos_sin_cache(head_dim, 8192, 10000.0)
    positions = torch.randint(0, 8192, (t,), generator=g)
    num_blocks = 256 // block_size + 8
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t]
    caches = [torch.zeros(num_blocks, block_size, hkv, head_dim, dtype=dtype) for _ in range(4)]
    got = nat.rope_write_kv_cpu(q, k, v, positions, cos_sin, caches[0], caches[1], slots)
    want = rope_write_kv_ref(q, k, v, positions, cos_sin, caches[2], caches[3], slots)
    for a, b in zip((*got, caches[0], caches[1]), (*want, caches[2], caches[3])):
        assert torch.equal(a, b)


def test_silu_mul_bf16_is_bit_exact():
    g = torch.Generator().manual_seed(3)
    gu = (4 * torch.randn(50, 2 * 1000, generator=g)).bfloat16()
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    assert torch.equal(nat.silu_mul_cpu(gu), silu_mul_ref(gu))


def test_silu_mul_bf16_matches_torch_for_every_bf16_gate():
    """All 65,282 finite, non-NaN bf16 gates (the up half is 1, and a product of two bf16 values is
    exact in fp32, so this covers every input pair's rounding). The only differences allowed are
    results at the edge of bf16's normal range or below it: AVX512-BF16's conversion flushes an
    fp32 subnormal to zero where torch rounds it (at most to the smallest normal, 1.2e-38); a
    model never tells such a value from zero."""
    g = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    g = g[torch.isfinite(g)]
    gu = torch.cat([g, torch.ones_like(g)])[None]
    got, want = nat.silu_mul_cpu(gu)[0], silu_mul_ref(gu)[0]
    differ = got != want
    assert bool((want[differ].float().abs() <= torch.finfo(torch.bfloat16).tiny).all())
    assert bool((got[differ] == 0).all())


def test_rms_norm_and_silu_fp32_match_reference():
    """fp32 has native kernels too: the same operations, reduction and exp orders aside."""
    g = torch.Generator().manual_seed(4)
    for rows, hidden in ((1, 64), (37, 576), (300, 100)):
        x, w = 3 * torch.randn(rows, hidden, generator=g), torch.randn(hidden, generator=g)
        res = torch.randn(rows, hidden, generator=g)
        for r in (None, res):
            got, h = nat.rms_norm_cpu(x, w, 1e-5, r)
            want, h_want = rms_norm_ref(x, w, 1e-5, r)
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
            assert (h is None) if r is None else torch.equal(h, h_want)
        wide = torch.randn(rows, hidden + 8, generator=g)
        torch.testing.assert_close(nat.rms_norm_cpu(wide[:, :hidden], w, 1e-6)[0],
                                   rms_norm_ref(wide[:, :hidden], w, 1e-6)[0], atol=1e-6, rtol=1e-5)
    gu = 4 * torch.randn(50, 2 * 1000, generator=g)
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    torch.testing.assert_close(nat.silu_mul_cpu(gu), silu_mul_ref(gu), atol=1e-6, rtol=1e-5)
    wide = torch.randn(3, 2 * 100 + 5, generator=g)[:, :200]
    torch.testing.assert_close(nat.silu_mul_cpu(wide), silu_mul_ref(wide), atol=1e-6, rtol=1e-5)


def test_wrappers_fall_back_for_other_dtypes():
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(4, 64, generator=g).half(), torch.randn(64, generator=g).half()
    assert torch.equal(nat.rms_norm_cpu(x, w, 1e-6)[0], rms_norm_ref(x, w, 1e-6)[0])
    gu = torch.randn(4, 128, generator=g).half()
    assert torch.equal(nat.silu_mul_cpu(gu), silu_mul_ref(gu))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cols", [5, 16, 49152 + 7])
def test_argmax_rows_matches_torch(dtype, cols):
    g = torch.Generator().manual_seed(cols)
    x = torch.randn(9, cols, generator=g).to(dtype)
    x[1] = 0.0                                  # all tied: the first index wins
    x[2] = float("-inf")
    x[3, cols // 2] = float("nan")              # NaN counts as the maximum
    x[4, -1] = 1e4                              # maximum in the scalar tail
    x[5, 0] = x[5, -1] = 1e4                    # tie between the first and the last column
    x[6, cols // 3] = float("nan")
    x[6, -1] = float("nan")                     # first NaN wins
    assert torch.equal(nat.argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(nat.argmax_rows(x[:, : cols - 1]), x[:, : cols - 1].argmax(dim=-1))  # strided rows


@pytest.mark.parametrize("hq,hkv,head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 48)])
def test_decode_step_matches_rope_then_attention(hq, hkv, head_dim):
    g = torch.Generator().manual_seed(hq + head_dim)
    lens = [1, 17, 40, 130, 16]
    batch = make_paged_batch(lens, hkv, head_dim, 16, torch.bfloat16, g)
    b = len(lens)
    qkv = torch.randn(b, (hq + 2 * hkv) * head_dim, generator=g).bfloat16()
    cos_sin = build_cos_sin_cache(head_dim, 512, 10000.0)
    positions = (batch.seq_lens - 1).to(torch.int64)  # each sequence's new token is its last
    bs = batch.k_cache.shape[1]
    slots = torch.tensor([int(batch.block_tables[i, p // bs]) * bs + p % bs for i, p in enumerate(positions.tolist())])
    caches = [batch.k_cache.clone(), batch.v_cache.clone()]
    got = nat.decode_step_cpu(qkv, hq, positions, cos_sin, slots, caches[0], caches[1], batch.block_tables,
                              batch.seq_lens, head_dim ** -0.5)
    assert got is not None
    qd, kvd = hq * head_dim, hkv * head_dim
    q, _ = rope_write_kv_ref(qkv[:, :qd].view(b, hq, head_dim), qkv[:, qd:qd + kvd].view(b, hkv, head_dim),
                             qkv[:, qd + kvd:].view(b, hkv, head_dim), positions, cos_sin, batch.k_cache,
                             batch.v_cache, slots)
    want = paged_decode_attention_ref(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                                      head_dim ** -0.5)
    assert torch.equal(caches[0], batch.k_cache) and torch.equal(caches[1], batch.v_cache)
    torch.testing.assert_close(got.view(b, hq, head_dim).float(), want.float(), atol=2e-2, rtol=2e-2)


def test_argmax_rows_never_builds_the_library_for_a_non_cpu_tensor(monkeypatch):
    """The native library is compiled on first use; a CUDA (here: meta) tensor must not trigger that."""
    def no_build():
        raise AssertionError("load_library called for a tensor the native kernel cannot take")

    monkeypatch.setattr(nat, "load_library", no_build)
    x = torch.empty(3, 50, device="meta")
    assert nat.argmax_rows(x).shape == (3,)
    assert torch.equal(nat.argmax_rows(torch.tensor([[1, 5, 2]])), torch.tensor([1]))  # int rows: torch path


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cols", [5, 64, 49152 + 7])
def test_apply_bitmask_matches_masked_fill(dtype, cols):
    """Packed int32 words (bit b of word w: token 32w + b allowed), on a subset of rows in any
    order: the same -inf as masked_fill with the unpacked mask, allowed logits untouched."""
    g = torch.Generator().manual_seed(cols)
    words = (cols + 31) // 32
    x = torch.randn(7, cols, generator=g).to(dtype)
    mask = torch.randint(-2 ** 31, 2 ** 31 - 1, (4, words), dtype=torch.int32, generator=g)
    mask[1] = -1                               # everything allowed
    mask[2] = 0                                # nothing allowed
    mask[3, ::2] = 0
    mask[3, 1::2] = -1                         # whole words of each kind, alternating
    rows = [5, 0, 6, 2]
    bits = (mask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    refused = (bits == 0).view(4, -1)[:, :cols]
    want = x.clone()
    want[rows] = want[rows].masked_fill(refused, float("-inf"))
    got = x.clone()
    assert nat.apply_bitmask_cpu(got, mask, rows)
    assert torch.equal(got, want)


def test_apply_bitmask_refuses_what_it_cannot_take():
    x = torch.zeros(2, 64)
    mask = torch.zeros(1, 2, dtype=torch.int32)
    assert not nat.apply_bitmask_cpu(x, mask, [2])                          # row out of range
    assert not nat.apply_bitmask_cpu(x, mask[:, :1], [0])                   # mask shorter than the vocabulary
    assert not nat.apply_bitmask_cpu(x.half(), mask, [0])                   # dtype without a kernel
    assert not nat.apply_bitmask_cpu(torch.zeros(2, 64, device="meta"), mask, [0])
    assert torch.equal(x, torch.zeros(2, 64))
