"""The compute dtype an engine runs: what ``--dtype`` says, or for ``auto`` (the default) what the
device computes natively.

Why it matters: on a CPU without bf16 instructions torch runs a bf16 matmul at about a third of
its fp32 rate (it converts every tile), so a bf16 default there gives a third of the speed the
hardware has; with AVX512_BF16 or AMX-BF16 bf16 is the faster path and halves the KV bytes.

Rules of ``auto`` (``choose_dtype``, pure): on CUDA, bfloat16 from compute capability 8.0
(Ampere) on, else float16; on CPU, bfloat16 when the CPU has ``amx_bf16`` or ``avx512_bf16``,
else float32 (CPUs with AVX512-FP16 have AMX-BF16 too, so they take bf16, the dtype kvmesh's
native CPU kernels are written for). An explicit dtype is kept as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")
AUTO = "auto"
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
"""/proc/cpuinfo flags of a CPU with native bf16 dot products, checked in this order."""


@dataclass(frozen=True)
class DtypeChoice:
    """``dtype`` (a name in ``DTYPES``) and why: ``source`` is "flag" (``--dtype``) or "auto"."""

    dtype: str
    source: str
    reason: str


def canonical_dtype(name: str) -> str:
    """``name`` as one of ``DTYPES`` or ``auto``; ValueError naming the choices otherwise."""
    n = str(name).lower()
    n = _ALIASES.get(n, n)
    if n not in (*DTYPES, AUTO):
        raise ValueError(f"unknown dtype {name!r}; use auto, float32, bfloat16 or float16")
    return n


def choose_dtype(requested: str, device_type: str, cpu_flags: frozenset[str] = frozenset(),
                 cuda_capability: tuple[int, int] | None = None) -> DtypeChoice:
    """The dtype for ``requested`` (a dtype name or ``auto``) on a ``cpu`` or ``cuda`` device."""
    name = canonical_dtype(requested)
    if name != AUTO:
        return DtypeChoice(name, "flag", f"--dtype {name}")
    if device_type == "cuda":
        major, minor = cuda_capability or (0, 0)
        if major >= 8:
            return DtypeChoice("bfloat16", "auto", f"CUDA compute capability {major}.{minor} has bf16 tensor cores")
        return DtypeChoice("float16", "auto", f"CUDA compute capability {major}.{minor} has no bf16 tensor cores")
    flag = next((f for f in BF16_CPU_FLAGS if f in cpu_flags), None)
    if flag is not None:
        return DtypeChoice("bfloat16", "auto", f"the CPU has {flag}: bf16 matmuls run natively")
    return DtypeChoice("float32", "auto", "the CPU has no AVX512_BF16 or AMX-BF16: bf16 would run at about "
                                          "a third of fp32's speed")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first CPU's feature flags (empty where /proc/cpuinfo is not there: ``auto`` picks fp32)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def resolve_dtype(requested: str, device: object) -> DtypeChoice:
    """``choose_dtype`` for a ``torch.device``, reading the CPU's flags or the GPU's capability."""
    kind = getattr(device, "type", str(device))
    if canonical_dtype(requested) != AUTO:
        return choose_dtype(requested, kind)
    if kind == "cuda":
        import torch

        return choose_dtype(requested, kind, cuda_capability=torch.cuda.get_device_capability(device))
    return choose_dtype(requested, kind, cpu_flags=cpu_flags())
