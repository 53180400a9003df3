"""bench/gpu_kernels.py: argument parsing, CPU refusal, and a dry run of the whole harness."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu_kernels.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("kvmesh_bench_kernels", BENCH)
    module = importlib.util.module_from_spec(spec)
    # dataclasses resolve string annotations through sys.modules.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_parse_args_lists_and_errors(bench, capsys):
    args = bench.parse_args(["--batch-sizes", "1,8", "--context-lens", "128", "--impl", "both"])
    assert args.batch_sizes == [1, 8] and args.context_lens == [128] and args.impl == "both"
    for bad in (["--batch-sizes", "1,x"], ["--context-lens", "0"], ["--num-q-heads", "9", "--num-kv-heads", "2"]):
        with pytest.raises(SystemExit) as exc:
            bench.parse_args(bad)
        assert exc.value.code == 2


def test_causal_flops(bench):
    # Plain prefill of 4 tokens: 1+2+3+4 = 10 visible pairs; after a 6-token prefix, 4*6 more.
    assert bench.causal_flops(4, 4, 2, 8) == 4.0 * 10 * 2 * 8
    assert bench.causal_flops(4, 10, 2, 8) == 4.0 * (10 + 24) * 2 * 8


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_refuses_without_gpu(bench, capsys):
    assert bench.main([]) == bench.EXIT_NO_DEVICE == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_dry_run_writes_json(bench, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench.main(["--dry-run", "--json", str(out)]) == 0
    report = capsys.readouterr().out
    assert "copy bandwidth" in report and "TFLOP/s" in report
    data = json.loads(out.read_text())
    assert data["dry_run"] is True and data["copy_bandwidth_gbps"] > 0
    assert len(data["decode"]) == len(bench.DRY_RUN_BATCHES) * len(bench.DRY_RUN_CONTEXTS)
    for row in data["decode"]:
        assert row["impl"] == "ref" and row["ms"] > 0
        assert row["kv_bytes"] == 2 * row["batch"] * row["context"] * 2 * 64 * 2  # K+V, 2 heads, bf16
    for row in data["prefill"]:
        assert row["flops"] == row["batch"] * bench.causal_flops(row["context"], row["context"], 4, 64)
