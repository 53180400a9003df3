"""Launch checks and small helpers shared by the kernel modules."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from kvmesh.engine.kernels._common import (
    TritonUnavailableError,
    check_gqa,
    check_triton_launch,
    flat_token_view,
    next_power_of_2,
)
from kvmesh.engine.kernels.rmsnorm import rms_norm_triton


def test_next_power_of_2():
    assert [next_power_of_2(n) for n in (1, 2, 3, 64, 65, 576)] == [1, 2, 4, 64, 128, 1024]
    with pytest.raises(ValueError):
        next_power_of_2(0)


def test_check_gqa():
    assert check_gqa(9, 3) == 3
    with pytest.raises(ValueError, match="multiple"):
        check_gqa(9, 2)


def test_flat_token_view_shares_storage_or_declines():
    cache = torch.zeros(4, 16, 2, 8)
    flat = flat_token_view(cache)
    flat[17] = 1.0
    assert cache[1, 1].eq(1.0).all()
    strided = torch.zeros(4, 2, 16, 2, 8)[:, 0]
    assert flat_token_view(strided) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_cpu_tensors_without_interpreter_are_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(TritonUnavailableError, match="need CUDA tensors"):
        check_triton_launch(torch.zeros(1))
    with pytest.raises(TritonUnavailableError):
        rms_norm_triton(torch.zeros(2, 8), torch.ones(8), 1e-5)


def test_mixed_devices_are_refused():
    with pytest.raises(ValueError, match="one device"):
        check_triton_launch(torch.zeros(1), torch.zeros(1, device="meta"))


def test_missing_triton_is_reported(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
    with pytest.raises(TritonUnavailableError, match="not installed"):
        check_triton_launch(torch.zeros(1))


def test_torch_path_runs_without_triton():
    # A fresh interpreter where `import triton` fails: every reference still runs.
    script = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None
        import torch
        from kvmesh.engine.kernels import decode_attention, extend_attention, rmsnorm, rope
        x = torch.randn(3, 16)
        rmsnorm.rms_norm_ref(x, torch.ones(16), 1e-5)
        table = rope.build_cos_sin_cache(16, 8, 10000.0)
        k_cache, v_cache = torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16)
        q = torch.randn(3, 2, 16)
        kv = torch.randn(3, 1, 16)
        q, _ = rope.rope_write_kv_ref(q, kv, kv, torch.arange(3), table, k_cache, v_cache, torch.arange(3))
        tables = torch.tensor([[0, 1]], dtype=torch.int32)
        lens = torch.tensor([3], dtype=torch.int32)
        decode_attention.paged_decode_attention_ref(q[2:], k_cache, v_cache, tables, lens, 0.25)
        qsl = torch.tensor([0, 3], dtype=torch.int32)
        extend_attention.paged_extend_attention_ref(q, k_cache, v_cache, tables, qsl, lens, 0.25)
        try:
            rmsnorm.rms_norm_triton(x, torch.ones(16), 1e-5)
        except RuntimeError as exc:
            print("refused:", exc)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "refused: the triton package is not installed" in result.stdout
