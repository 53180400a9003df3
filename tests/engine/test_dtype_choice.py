"""`--dtype auto`: the pure rule on every kind of device, the CPU flags it reads, and the engine
and config that use it. Real: the rule, /proc/cpuinfo of this machine, EngineConfig's parser."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvmesh.engine.config import ConfigError, EngineConfig, parse_dtype
from kvmesh.engine.dtype_choice import choose_dtype, cpu_flags, resolve_dtype


@pytest.mark.parametrize("flags, want", [
    ({"avx512f", "avx512_bf16"}, "bfloat16"),
    ({"avx512f", "amx_bf16", "amx_tile", "avx512_fp16"}, "bfloat16"),
    ({"avx512f", "avx512bw", "avx512_vnni"}, "float32"),  # a Xeon without AVX512_BF16
    ({"avx2", "fma"}, "float32"),
    (set(), "float32"),  # nothing known: the safe choice
])
def test_auto_on_cpu_follows_the_bf16_instructions(flags, want):
    c = choose_dtype("auto", "cpu", frozenset(flags))
    assert (c.dtype, c.source) == (want, "auto")
    assert ("bf16" in c.reason.lower()) and c.reason


@pytest.mark.parametrize("cap, want", [((9, 0), "bfloat16"), ((8, 0), "bfloat16"), ((7, 5), "float16")])
def test_auto_on_cuda_follows_the_compute_capability(cap, want):
    c = choose_dtype("auto", "cuda", cuda_capability=cap)
    assert c.dtype == want and f"{cap[0]}.{cap[1]}" in c.reason


@pytest.mark.parametrize("name, want", [("float32", "float32"), ("bf16", "bfloat16"), ("FP16", "float16")])
def test_an_explicit_dtype_is_kept_on_any_device(name, want):
    for device in ("cpu", "cuda"):
        c = choose_dtype(name, device, frozenset({"avx512_bf16"}), (9, 0))
        assert (c.dtype, c.source) == (want, "flag")


def test_an_unknown_dtype_names_the_choices():
    with pytest.raises(ConfigError, match="auto, float32, bfloat16 or float16"):
        EngineConfig(dtype="fp8").validate()
    with pytest.raises(ConfigError, match="resolved"):
        parse_dtype("auto")


def test_cpu_flags_are_read_from_cpuinfo(tmp_path: Path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\n")
    assert cpu_flags(info) == frozenset({"fpu", "avx2", "avx512_bf16"})
    assert cpu_flags(tmp_path / "missing") == frozenset()


def test_auto_is_the_default_and_resolves_for_this_machine():
    cfg = EngineConfig(device="cpu")
    assert cfg.dtype == "auto"
    want = "bfloat16" if {"avx512_bf16", "amx_bf16"} & cpu_flags() else "float32"
    assert cfg.dtype_choice().dtype == want
    assert cfg.torch_dtype() == getattr(torch, want)
    assert resolve_dtype("float32", torch.device("cpu")).source == "flag"
