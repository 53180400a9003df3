"""Compile every Triton kernel for an H100/H200 (sm_90) without a GPU.

Run as a script in a process where TRITON_INTERPRET is unset (the interpreter replaces the
kernels with Python functions at import). It catches what the interpreter cannot: dot shape
limits, type errors in compiled control flow, constexpr misuse. It proves nothing about
results. Prints one line per compiled variant and exits non-zero on the first failure.
With ``KVMESH_SM90_RESOURCES=1`` each line also gives the cubin's shared memory, registers and
spill stack per thread (read with the cuobjdump that ships with Triton).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("unset TRITON_INTERPRET to compile kernels")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kvmesh.engine.kernels._decode_kernel import decode_reduce_kernel, decode_split_kernel  # noqa: E402
from kvmesh.engine.kernels._extend_kernel import extend_attention_kernel  # noqa: E402
from kvmesh.engine.kernels._gated_delta_kernel import (  # noqa: E402
    gd_chunk_prep_kernel,
    gd_chunk_scan_kernel,
    gd_recurrent_step_kernel,
)
from kvmesh.engine.kernels.gated_delta_triton import (  # noqa: E402
    DOT_PRECISION,
    KERNEL_CHUNK,
    PREP_LAUNCH,
    SCAN_LAUNCH,
    STEP_LAUNCH,
    value_tile,
)
from kvmesh.engine.kernels._rmsnorm_kernel import rms_norm_kernel  # noqa: E402
from kvmesh.engine.kernels._rope_kernel import rope_write_kv_kernel  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
SHARED_MEMORY_LIMIT = 232448  # bytes per block on sm_90 (227 KiB); a launch over it fails


def resource_usage(kernel) -> str:
    """`` shared=B regs=N stack=B`` of a compiled kernel when KVMESH_SM90_RESOURCES=1, else ``""``."""
    if os.environ.get("KVMESH_SM90_RESOURCES") != "1":
        return ""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        dump = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", dump)
    regs, stack = m.groups() if m else ("?", "?")
    return f" shared={kernel.metadata.shared} regs={regs} stack={stack}"


def compile_kernel(fn, types: dict[str, str], constexprs: dict, **options) -> str:
    """Compile ``fn`` with pointer/float types from ``types`` and i32 for other runtime args, and
    check its shared memory fits an sm_90 block. Returns :func:`resource_usage`."""
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
    src = ASTSource(fn, signature, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    kernel = triton.compile(src, target=TARGET, options={"num_warps": 4, **options})
    if kernel.metadata.shared > SHARED_MEMORY_LIMIT:
        raise RuntimeError(f"{fn.__name__} {constexprs} {options} needs {kernel.metadata.shared} bytes of "
                           f"shared memory; sm_90 has {SHARED_MEMORY_LIMIT}")
    return resource_usage(kernel)


def _ptrs(names: list[str], dtype: str) -> dict[str, str]:
    return {n: f"*{dtype}" for n in names}


def main() -> int:
    for dt, dot, prec, head_dim in (("bf16", tl.bfloat16, "tf32", 128), ("fp32", tl.float32, "ieee", 64)):
        types = {**_ptrs(["x_ptr", "r_ptr", "h_ptr", "w_ptr", "out_ptr"], dt), "eps": "fp32"}
        compile_kernel(rms_norm_kernel, types, {"HAS_RESIDUAL": True, "BLOCK": 1024}, enable_fp_fusion=False)
        print(f"rms_norm_kernel {dt}")

        types = {
            **_ptrs(["q_ptr", "k_ptr", "v_ptr", "kc_ptr", "vc_ptr", "qo_ptr", "ko_ptr"], dt),
            "pos_ptr": "*i64", "slot_ptr": "*i64", "cs_ptr": "*fp32",
        }
        consts = {"HALF": head_dim // 2, "BLOCK_HQ": 16, "BLOCK_HKV": 4, "BLOCK_HALF": head_dim // 2}
        compile_kernel(rope_write_kv_kernel, types, consts, enable_fp_fusion=False)
        print(f"rope_write_kv_kernel {dt}")

        for direct in (False, True):
            part = dt if direct else "fp32"
            types = {
                **_ptrs(["q_ptr", "kc_ptr", "vc_ptr"], dt), "bt_ptr": "*i32", "sl_ptr": "*i32",
                "part_ptr": f"*{part}", "lse_ptr": f"*{part}", "scale": "fp32",
            }
            consts = {"BLOCK_H": 16, "BLOCK_N": 64, "BLOCK_D": head_dim, "DIRECT": direct,
                      "DOT_DTYPE": dot, "DOT_PRECISION": prec}
            compile_kernel(decode_split_kernel, types, consts)
            print(f"decode_split_kernel {dt} direct={direct}")
        types = {"part_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": f"*{dt}"}
        compile_kernel(decode_reduce_kernel, types, {"BLOCK_S": 8, "BLOCK_D": head_dim})
        print(f"decode_reduce_kernel {dt}")

        types = {
            **_ptrs(["q_ptr", "kc_ptr", "vc_ptr", "out_ptr"], dt),
            "bt_ptr": "*i32", "qsl_ptr": "*i32", "sl_ptr": "*i32", "scale": "fp32",
        }
        consts = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_D": head_dim, "DOT_DTYPE": dot, "DOT_PRECISION": prec}
        compile_kernel(extend_attention_kernel, types, consts)
        print(f"extend_attention_kernel {dt}")
    compile_gated_delta()
    return 0


def compile_gated_delta() -> None:
    """The gated delta rule's kernels (fp32 only) at Qwen3.5's head sizes (Dk = Dv = 128) with the
    default chunk, and at 64 with the reference's 64-token chunk; the scan with and without captures."""
    for dk, dv, bt in ((128, 128, KERNEL_CHUNK), (64, 64, 64)):
        bk, bv = dk, value_tile(dk, dv)
        types = _ptrs(["k_ptr", "v_ptr", "g_ptr", "beta_ptr", "u_ptr", "w_ptr", "cum_ptr"], "fp32")
        use = compile_kernel(gd_chunk_prep_kernel, types,
                             {"BT": bt, "BK": bk, "BDV": dv, "DOT_PRECISION": DOT_PRECISION}, **PREP_LAUNCH)
        print(f"gd_chunk_prep_kernel dk={dk} dv={dv} chunk={bt}{use}")
        for capture in (False, True):
            types = {
                **_ptrs(["q_ptr", "k_ptr", "u_ptr", "w_ptr", "cum_ptr", "s0_ptr", "out_ptr", "s1_ptr", "cap_ptr"],
                        "fp32"),
                **_ptrs(["cap_tok_ptr", "cap_row_ptr", "cap_lo_ptr"], "i32"),
            }
            use = compile_kernel(gd_chunk_scan_kernel, types, {"BT": bt, "BK": bk, "BV": bv, "HAS_CAPTURE": capture,
                                                               "DOT_PRECISION": DOT_PRECISION}, **SCAN_LAUNCH)
            print(f"gd_chunk_scan_kernel dk={dk} dv={dv} chunk={bt} capture={capture}{use}")
        types = _ptrs(["q_ptr", "k_ptr", "v_ptr", "g_ptr", "beta_ptr", "s0_ptr", "out_ptr", "s1_ptr"], "fp32")
        use = compile_kernel(gd_recurrent_step_kernel, types, {"BK": bk, "BV": bv}, **STEP_LAUNCH)
        print(f"gd_recurrent_step_kernel dk={dk} dv={dv}{use}")


if __name__ == "__main__":
    sys.exit(main())
