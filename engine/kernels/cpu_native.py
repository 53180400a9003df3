"""Native CPU paged decode attention, compiled on first use with the system C compiler.

The torch reference has to gather every sequence's K/V into a padded copy before
SDPA can read it; at decode time that copy costs more than the attention itself.
The C kernel (csrc/cpu_decode_attention.c) reads K/V rows straight out of the
paged cache. It is built once per source version and CPU into the kvmesh cache
directory; without a C compiler, or for dtypes it does not cover, callers fall
back to `paged_decode_attention_ref`.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from kvmesh.engine.kernels.decode_attention import paged_decode_attention_ref

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "cpu_decode_attention.c"
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _cache_dir() -> Path:
    root = os.environ.get("KVMESH_CACHE_DIR") or os.path.join(Path.home(), ".cache", "kvmesh")
    return Path(root) / "cpu-kernels"


def _cpu_fingerprint() -> str:
    """-march=native output is only valid on CPUs with the same features."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return platform.machine() + flags


def _build(cc: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        proc = subprocess.run([cc, *_FLAGS, str(_SOURCE), "-o", str(out), "-lm"],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed to build the CPU decode kernel:\n{proc.stderr[-2000:]}")
        os.replace(out, target)  # atomic: concurrent builders never load a partial file


def load_library() -> ctypes.CDLL | None:
    """The compiled kernel library, building it if needed; None if it cannot be built."""
    global _lib, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("KVMESH_DISABLE_NATIVE_CPU") == "1":
            return None
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            log.warning("no C compiler found; CPU decode attention uses the slower torch path")
            return None
        key = hashlib.sha256(_SOURCE.read_bytes() + " ".join(_FLAGS).encode()
                             + _cpu_fingerprint().encode()).hexdigest()[:16]
        target = _cache_dir() / f"cpu_decode_attention-{key}.so"
        try:
            if not target.exists():
                _build(cc, target)
            lib = ctypes.CDLL(str(target))
        except (OSError, RuntimeError) as e:
            log.warning("CPU decode kernel unavailable (%s); using the torch path", e)
            return None
        for name in ("kvmesh_decode_attention_f32", "kvmesh_decode_attention_bf16"):
            fn = getattr(lib, name)
            fn.restype = None
            fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p] \
                + [ctypes.c_int] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_float, ctypes.c_int]
        _lib = lib
        return lib


def native_available() -> bool:
    return load_library() is not None


def paged_decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Same contract as `paged_decode_attention_ref`; native for fp32/bf16 CPU tensors."""
    lib = load_library()
    b, hq, d = q.shape
    hkv = k_cache.shape[2]
    ok = (
        lib is not None and q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)
        and k_cache.dtype == q.dtype and v_cache.dtype == q.dtype
        and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
        and d <= 256 and hq // hkv <= 16 and block_tables.dtype == torch.int32
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
    fn = lib.kvmesh_decode_attention_f32 if q.dtype == torch.float32 else lib.kvmesh_decode_attention_bf16
    sb, ss, sh, _ = k_cache.stride()
    fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), bt.data_ptr(), bt.stride(0), sl.data_ptr(),
       out.data_ptr(), b, hq, hkv, d, k_cache.shape[1], sb, ss, sh, float(scale), torch.get_num_threads())
    return out
