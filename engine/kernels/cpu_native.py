"""Native CPU kernels, compiled on first use with the system C compiler.

- Paged decode attention (csrc/cpu_decode_attention.c): the torch reference has to
  gather every sequence's K/V into a padded copy before SDPA can read it; at decode
  time that copy costs more than the attention itself. The C kernel reads K/V rows
  straight out of the paged cache.
- fp32 products with weights kept block-quantized (csrc/cpu_qlinear.c, quant_rows.py).
- Fused bf16 elementwise kernels (csrc/cpu_elementwise.c): residual add + RMSNorm,
  RoPE with the KV write, SiLU * up. Each replaces several torch ops and their
  temporaries per layer and rounds where the torch reference rounds.

The library is built once per source version and CPU into the kvmesh cache
directory. Every wrapper has the contract of its torch reference and falls back to
it without a C compiler, or for dtypes and layouts the C code does not cover.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import threading
from pathlib import Path

import torch

from kvmesh.engine.kernels.activation import silu_mul_ref
from kvmesh.engine.kernels.decode_attention import paged_decode_attention_ref
from kvmesh.engine.kernels.extend_attention import paged_extend_attention_ref
from kvmesh.engine.kernels.rmsnorm import _check_inputs as _check_rms_inputs
from kvmesh.engine.kernels.rmsnorm import rms_norm_ref
from kvmesh.engine.kernels.rope import _check_rope_inputs, rope_write_kv_ref
from kvmesh.engine.util.cache_dir import building, default_cache_dir

log = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = ("cpu_decode_attention.c", "cpu_decode_amx.c", "cpu_extend_attention.c", "cpu_extend_amx.c",
            "cpu_elementwise.c", "cpu_bitmask.c", "cpu_qlinear.c", "cpu_amx.c")
_HEADERS = ("kvmesh_cpu.h", "amx_attention.h")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_DECODE_ARGS = [_P] * 4 + [_I64, _P, _P] + [_I] * 5 + [_I64] * 3 + [_F, _I, _I]
_RMS_ARGS = [_P, _I64, _P, _I64, _P, _P, _P, _I64, _I, _F, _I]
_ROPE_ARGS = [_P, _I64, _P, _I64, _P, _I64, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I, _P, _P, _I64, _I, _I, _I, _I]
_SILU_ARGS = [_P, _I64, _P, _I64, _I, _I]
_EXTEND_ARGS = [_P] * 4 + [_I64, _I, _P, _P, _P] + [_I] * 5 + [_I64] * 3 + [_F, _I]
# The fused elementwise kernels exist in these dtypes (suffix of their C names).
_ELEMENTWISE = {torch.bfloat16: "bf16", torch.float32: "f32"}
_SIGNATURES = {  # C prototypes; keep in step with csrc/
    "kvmesh_decode_attention_f32": _DECODE_ARGS,
    "kvmesh_decode_attention_bf16": _DECODE_ARGS,
    "kvmesh_rms_norm_bf16": _RMS_ARGS,
    "kvmesh_rms_norm_f32": _RMS_ARGS,
    "kvmesh_rope_write_kv_bf16": _ROPE_ARGS,
    "kvmesh_rope_write_kv_f32": _ROPE_ARGS,
    "kvmesh_silu_mul_bf16": _SILU_ARGS,
    "kvmesh_silu_mul_f32": _SILU_ARGS,
    "kvmesh_extend_attention_bf16": _EXTEND_ARGS,
    "kvmesh_extend_attention_f32": _EXTEND_ARGS,
    "kvmesh_extend_attention_bf16_amx": _EXTEND_ARGS,
    "kvmesh_decode_attention_bf16_amx": _DECODE_ARGS,
    "kvmesh_decode_step_bf16": [_P, _I64, _P, _P, _P, _P, _P, _P, _I64, _P, _P] + [_I] * 5 + [_I64] * 3 + [_F, _I, _I],
    "kvmesh_argmax_bf16": [_P, _I64, _I64, _I64, _P, _I],
    "kvmesh_argmax_f32": [_P, _I64, _I64, _I64, _P, _I],
    "kvmesh_apply_bitmask_bf16": [_P, _I64, _P, _I64, _P, _I64, _I64],
    "kvmesh_apply_bitmask_u32": [_P, _I64, _P, _I64, _P, _I64, _I64],
    "kvmesh_qlinear_f32": [_P, _I64, _P, _P, _P, _I, _P, _I64, _I, _I, _I, _I],
    "kvmesh_dequant_rows_f32": [_P, _P, _P, _I, _P, _I, _I],
    "kvmesh_qlinear_bf16_amx": [_P, _I64, _P, _P, _P, _I, _P, _I64, _I, _I, _I, _I],
    "kvmesh_dequant_rows_bf16": [_P, _P, _P, _I, _P, _I, _I],
}
_RETURNS = {"kvmesh_decode_attention_bf16_amx": ctypes.c_int,
            "kvmesh_extend_attention_bf16": ctypes.c_int, "kvmesh_extend_attention_f32": ctypes.c_int,
            "kvmesh_extend_attention_bf16_amx": ctypes.c_int,
            "kvmesh_decode_step_bf16": ctypes.c_int, "kvmesh_qlinear_f32": ctypes.c_int,
            "kvmesh_dequant_rows_f32": ctypes.c_int, "kvmesh_qlinear_bf16_amx": ctypes.c_int,
            "kvmesh_dequant_rows_bf16": ctypes.c_int}


def _cache_dir() -> Path:
    return default_cache_dir() / "cpu-kernels"


def _cpu_fingerprint() -> str:
    """-march=native output is only valid on CPUs with the same features."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return platform.machine() + flags


def _build(cc: str, target: Path, march: str) -> None:
    flags = [f if f != "-march=native" else f"-march={march}" for f in _FLAGS]
    with building(target) as out:
        proc = subprocess.run([cc, *flags, *(str(_CSRC / f) for f in _SOURCES), "-o", str(out), "-lm"],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed to build the native CPU kernels:\n{proc.stderr[-2000:]}")


def build_library(march: str = "native", cache_dir: Path | None = None) -> ctypes.CDLL:
    """Compile (once per source version, flags and CPU) and load the kernels for `march`.

    Raises RuntimeError without a C compiler or when the build fails. Tests build the
    portable variant (e.g. march="x86-64-v2") this way to cover CPUs without AVX512.
    """
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler found (set CC or install cc/gcc)")
    digest = hashlib.sha256(" ".join(_FLAGS).encode() + march.encode() + _cpu_fingerprint().encode())
    for name in _SOURCES + _HEADERS:
        digest.update((_CSRC / name).read_bytes())
    target = (cache_dir or _cache_dir()) / f"kvmesh_cpu-{digest.hexdigest()[:16]}.so"
    if not target.exists():
        _build(cc, target, march)
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as e:
        raise RuntimeError(f"cannot load {target}: {e}") from e
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = _RETURNS.get(name)
        fn.argtypes = argtypes
    return lib


def load_library() -> ctypes.CDLL | None:
    """The compiled kernel library for this CPU, built on first use; None if it cannot be built."""
    global _lib, _tried
    if _tried:  # every kernel call asks; skip the lock once the answer is known
        return _lib
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("KVMESH_DISABLE_NATIVE_CPU") == "1":
            return None
        try:
            _lib = build_library()
        except RuntimeError as e:
            log.warning("native CPU kernels unavailable (%s); using the torch kernels", e)
            return None
        return _lib


def native_available() -> bool:
    return load_library() is not None


def _paged_cache_ok(k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype) -> bool:
    """K/V caches the C kernels can address: [blocks, block_size, heads, D] on CPU in
    `dtype`, one shared stride set, head dimension contiguous."""
    return (k_cache.dim() == 4 and k_cache.device.type == "cpu" and k_cache.dtype == dtype
            and v_cache.dtype == dtype and k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1)


def paged_decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int | None = None,
    group_prefixes: bool = True,
    tiles: bool = True,
) -> torch.Tensor:
    """Same contract as `paged_decode_attention_ref`; native for fp32/bf16 CPU tensors.

    With ``group_prefixes`` the kernel runs sequences that start in the same KV block (a shared
    prefix) back to back, so the prefix is read from memory once per step rather than once per
    sequence; results are identical either way (bench/cpu_kernels.py measures it). With ``tiles``,
    bf16 runs on AMX tiles where the CPU has AMX-BF16 (csrc/cpu_decode_amx.c: the query rows of
    up to 16 / G sequences of one prefix multiply together); elsewhere, or for shapes it does not
    take, on the AVX-512 kernel."""
    lib = load_library()
    b, hq, d = q.shape
    hkv = k_cache.shape[2]
    ok = (
        lib is not None and q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)
        and _paged_cache_ok(k_cache, v_cache, q.dtype) and d <= 256 and hq // hkv <= 16 and block_tables.dtype == torch.int32
        and seq_lens.dtype == torch.int32
    )
    if not ok:
        return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                          max_seq_len=max_seq_len)
    q = q.contiguous()
    bt = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    sl = seq_lens.contiguous()
    out = torch.empty_like(q)
    if b == 0:
        return out
    sb, ss, sh, _ = k_cache.stride()
    args = (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), bt.data_ptr(), bt.stride(0), sl.data_ptr(),
            out.data_ptr(), b, hq, hkv, d, k_cache.shape[1], sb, ss, sh, float(scale), torch.get_num_threads(),
            int(group_prefixes))
    if q.dtype == torch.float32:
        lib.kvmesh_decode_attention_f32(*args)
    elif not tiles or lib.kvmesh_decode_attention_bf16_amx(*args) != 0:
        lib.kvmesh_decode_attention_bf16(*args)
    return out


def paged_extend_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    bf16_sdpa: bool = False,
    tiles: bool = True,
) -> torch.Tensor:
    """Same contract as `extend_attention.paged_extend_attention_ref`; native for bf16 and fp32.

    bf16 runs on AMX tiles where the CPU has AMX-BF16 and ``tiles`` (csrc/cpu_extend_amx.c:
    block_size % 16 == 0, head dim 64 or 128); elsewhere the AVX-512 kernel, or torch's SDPA with
    ``bf16_sdpa`` (see `sdpa_beats_native_bf16_extend`)."""
    lib = load_library()
    ok = (
        lib is not None and q.dim() == 3 and q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float32)
        and _paged_cache_ok(k_cache, v_cache, q.dtype)
        and q.shape[2] == k_cache.shape[3] and q.shape[1] % k_cache.shape[2] == 0
        and block_tables.dtype == torch.int32 and block_tables.dim() == 2
        and query_start_loc.dtype == torch.int32 and seq_lens.dtype == torch.int32
        and seq_lens.dim() == 1 and query_start_loc.shape == (seq_lens.shape[0] + 1,)
        and block_tables.shape[0] == seq_lens.shape[0]
    )
    if ok:
        q = q.contiguous()
        bt = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
        qsl, sl = query_start_loc.contiguous(), seq_lens.contiguous()
        out = torch.empty_like(q)
        t, hq, d = q.shape
        sb, ss, sh, _ = k_cache.stride()
        args = (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), bt.data_ptr(), bt.stride(0), bt.shape[1],
                qsl.data_ptr(), sl.data_ptr(), out.data_ptr(), sl.shape[0], hq, k_cache.shape[2], d,
                k_cache.shape[1], sb, ss, sh, float(scale), torch.get_num_threads())
        if q.dtype == torch.float32:
            kernels = [lib.kvmesh_extend_attention_f32]
        else:
            kernels = [lib.kvmesh_extend_attention_bf16_amx] if tiles else []
            kernels += [] if bf16_sdpa else [lib.kvmesh_extend_attention_bf16]
        for fn in kernels:
            if fn(*args) == 0:
                return out
    return paged_extend_attention_ref(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                                      max_query_len=max_query_len)


def sdpa_beats_native_bf16_extend(cpu_flags: frozenset[str]) -> bool:
    """Whether bf16 prefill attention the AMX kernel cannot take (another head dim or block size)
    should run torch's SDPA instead of the AVX-512 kernel.

    With AMX-BF16, torch's CPU flash attention multiplies on AMX tiles (oneDNN's brgemm), which
    the AVX-512 kernel's dot products cannot match: 1.9-3.5x faster for 512-2,048-token chunks on
    an AMX Xeon (docs/benchmarks.md). Without AMX the native kernel is the faster one, and in fp32
    it is on both (1.0-1.5x on the same Xeon)."""
    return "amx_bf16" in cpu_flags


def decode_step_cpu(
    qkv: torch.Tensor,
    num_heads: int,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    tiles: bool = True,
) -> torch.Tensor | None:
    """RoPE + KV write + decode attention for one query row per sequence, in one call.

    qkv: bf16 [B, (Hq + 2 Hkv) D] rows (q | k | v); returns [B, Hq D], or None where the
    native code does not apply (the caller then runs the separate kernels). ``tiles``: as in
    `paged_decode_attention_cpu`.
    """
    lib = load_library()
    if lib is None or not _bf16_rows(qkv) or not _paged_cache_ok(k_cache, v_cache, torch.bfloat16) \
            or cos_sin.dtype != torch.float32 \
            or not cos_sin.is_contiguous() or positions.dtype != torch.int64 or slot_mapping.dtype != torch.int64 \
            or block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32 or block_tables.stride(1) != 1:
        return None
    b = qkv.shape[0]
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    if (qkv.shape[1] != (num_heads + 2 * hkv) * d or num_heads % hkv or cos_sin.shape[1] != d
            or d > 256 or num_heads // hkv > 16
            or positions.shape != (b,) or slot_mapping.shape != (b,) or seq_lens.shape != (b,)):
        return None
    out = torch.empty((b, num_heads * d), dtype=torch.bfloat16)
    sb, ss, sh, _ = k_cache.stride()
    rc = lib.kvmesh_decode_step_bf16(
        qkv.data_ptr(), qkv.stride(0), positions.data_ptr(), cos_sin.data_ptr(), slot_mapping.data_ptr(),
        k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
        seq_lens.data_ptr(), out.data_ptr(), b, num_heads, hkv, d, k_cache.shape[1], sb, ss, sh, float(scale),
        torch.get_num_threads(), int(tiles))
    return out if rc == 0 else None


def _bf16_rows(x: torch.Tensor) -> bool:
    """A bf16 CPU matrix whose rows are contiguous (any row stride)."""
    return _rows(x, torch.bfloat16)


def _rows(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """A CPU matrix of ``dtype`` whose rows are contiguous (any row stride)."""
    return x.device.type == "cpu" and x.dtype == dtype and x.dim() == 2 and x.stride(1) == 1


def rms_norm_cpu(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract as `rmsnorm.rms_norm_ref`; native for bf16 or fp32 [T, hidden] with a weight
    of the same dtype."""
    _check_rms_inputs(x, weight, residual)
    dt = x.dtype
    lib = load_library() if dt in _ELEMENTWISE else None
    if (lib is None or not _rows(x, dt) or weight.dtype != dt or not weight.is_contiguous()
            or weight.shape != (x.shape[1],)
            or (residual is not None and (not _rows(residual, dt) or residual.shape != x.shape))):
        return rms_norm_ref(x, weight, eps, residual)
    t, n = x.shape
    out = torch.empty((t, n), dtype=dt)
    h = torch.empty((t, n), dtype=dt) if residual is not None else None
    getattr(lib, "kvmesh_rms_norm_" + _ELEMENTWISE[dt])(
        x.data_ptr(), x.stride(0), residual.data_ptr() if residual is not None else None,
        residual.stride(0) if residual is not None else 0, weight.data_ptr(), out.data_ptr(),
        h.data_ptr() if h is not None else None, t, n, float(eps), torch.get_num_threads())
    return out, h


def rope_write_kv_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `rope.rope_write_kv_ref`; native for bf16 or fp32 tensors whose heads
    are contiguous rows (q, k, v may be column slices of one fused projection)."""
    _check_rope_inputs(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)
    dt = q.dtype
    lib = load_library() if dt in _ELEMENTWISE else None
    ok = (
        lib is not None and q.dim() == 3 and k.dim() == 3 and v.shape == k.shape
        and all(a.device.type == "cpu" and a.dtype == dt for a in (q, k, v))
        and all(a.stride(2) == 1 and a.stride(1) == a.shape[2] for a in (q, k, v))
        and _paged_cache_ok(k_cache, v_cache, dt)
        and cos_sin.dtype == torch.float32 and cos_sin.is_contiguous() and cos_sin.shape[1] == q.shape[2]
        and positions.dtype == torch.int64 and slot_mapping.dtype == torch.int64
        and k.shape[1:] == k_cache.shape[2:]
    )
    if not ok:
        return rope_write_kv_ref(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)
    t, hq, d = q.shape
    hkv = k.shape[1]
    q_rot = torch.empty((t, hq, d), dtype=dt)
    k_rot = torch.empty((t, hkv, d), dtype=dt)
    pos, slots = positions.contiguous(), slot_mapping.contiguous()
    cb, cs, ch, _ = k_cache.stride()
    getattr(lib, "kvmesh_rope_write_kv_" + _ELEMENTWISE[dt])(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), pos.data_ptr(),
        cos_sin.data_ptr(), slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), cb, cs, ch,
        k_cache.shape[1], q_rot.data_ptr(), k_rot.data_ptr(), t, hq, hkv, d, torch.get_num_threads())
    return q_rot, k_rot


def silu_mul_cpu(gate_up: torch.Tensor) -> torch.Tensor:
    """Same contract as `activation.silu_mul_ref`; native for bf16 or fp32 [T, 2 * I]."""
    dt = gate_up.dtype
    lib = load_library() if dt in _ELEMENTWISE else None
    if lib is None or not _rows(gate_up, dt) or gate_up.shape[1] % 2:
        return silu_mul_ref(gate_up)
    t, i2 = gate_up.shape
    out = torch.empty((t, i2 // 2), dtype=dt)
    getattr(lib, "kvmesh_silu_mul_" + _ELEMENTWISE[dt])(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), t,
                                                        i2 // 2, torch.get_num_threads())
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for a 2-D tensor (first maximum; NaN counts as the maximum).

    Native for bf16/fp32 CPU rows: torch's argmax runs on one thread, and at a 49k-word
    vocabulary it costs more per decode step than every RMSNorm of the model together.
    """
    # Shape and device first: load_library() compiles the library on first use, which a CUDA
    # tensor (or any other that cannot take the native path) must never trigger.
    if x.dim() != 2 or x.device.type != "cpu" or x.stride(1) != 1 \
            or x.dtype not in (torch.bfloat16, torch.float32) or x.shape[1] == 0:
        return x.argmax(dim=-1)
    lib = load_library()
    if lib is None:
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    fn = lib.kvmesh_argmax_bf16 if x.dtype == torch.bfloat16 else lib.kvmesh_argmax_f32
    fn(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(), torch.get_num_threads())
    return out


def apply_bitmask_cpu(logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> bool:
    """Set ``logits[rows[i], t]`` to -inf wherever bit t of ``mask[i]`` is clear, in place.

    ``mask``: [len(rows), ceil(vocab / 32)] int32 words as llguidance fills them (bit b of word
    w is token 32 * w + b); ``rows``: row indices, one per mask row. Allowed logits are untouched, so this
    equals ``masked_fill_`` with the unpacked mask bit for bit. Returns False, touching nothing,
    when the native path cannot take the tensors (not CPU, not bf16/fp32, non-unit column stride,
    a mask too short for the vocabulary, a row out of range, no library): the caller then uses
    its torch path.
    """
    if (logits.dim() != 2 or logits.device.type != "cpu" or logits.stride(1) != 1
            or logits.dtype not in (torch.bfloat16, torch.float32)
            or mask.dtype != torch.int32 or mask.device.type != "cpu" or mask.dim() != 2 or mask.stride(1) != 1
            or mask.shape[1] * 32 < logits.shape[1] or len(rows) != mask.shape[0]
            or (rows and (min(rows) < 0 or max(rows) >= logits.shape[0]))):
        return False
    lib = load_library()
    if lib is None:
        return False
    fn = lib.kvmesh_apply_bitmask_bf16 if logits.dtype == torch.bfloat16 else lib.kvmesh_apply_bitmask_u32
    at = torch.tensor(rows, dtype=torch.int64)
    fn(logits.data_ptr(), logits.stride(0), mask.data_ptr(), mask.stride(0), at.data_ptr(), len(rows), logits.shape[1])
    return True
