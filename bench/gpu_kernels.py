"""Attention kernel benchmark: decode bandwidth and prefill throughput on one GPU.

Decode is memory-bound, so it is reported as achieved GB/s (bytes of K and V read divided by
time) next to the device's measured copy bandwidth (a large device-to-device ``copy_``, read
plus write bytes). Prefill is compute-bound and is reported as TFLOP/s of causal attention
(4 * visible query-key pairs * heads * head_dim). Timing uses CUDA events around several
iterations after a warmup.

    python bench/gpu_kernels.py                          # default sweep, Triton kernels
    python bench/gpu_kernels.py --impl both --json out.json
    python bench/gpu_kernels.py --dry-run                # CPU, torch reference, tiny sizes:
                                                     # proves the harness, numbers mean nothing

Without a CUDA device (and without --dry-run) it exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from kvmesh.engine.kernels.decode_attention import paged_decode_attention_ref, paged_decode_attention_triton
from kvmesh.engine.kernels.extend_attention import paged_extend_attention_ref, paged_extend_attention_triton

EXIT_NO_DEVICE = 2
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DRY_RUN_BATCHES = [1, 2]
DRY_RUN_CONTEXTS = [16, 48]


@dataclass
class DecodeRow:
    impl: str
    batch: int
    context: int
    ms: float
    kv_bytes: int
    gbps: float
    fraction_of_copy: float


@dataclass
class PrefillRow:
    impl: str
    batch: int
    context: int
    ms: float
    flops: float
    tflops: float


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", type=_int_list, default=[1, 8, 32, 64, 128, 256])
    p.add_argument("--context-lens", type=_int_list, default=[512, 2048, 8192, 32768])
    p.add_argument("--prefill-batch-sizes", type=_int_list, default=[1, 4, 16])
    p.add_argument("--prefill-lens", type=_int_list, default=[512, 2048, 8192])
    p.add_argument("--num-q-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--impl", choices=["triton", "ref", "both"], default="triton")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--copy-mib", type=int, default=1024, help="buffer size for the copy-bandwidth probe")
    p.add_argument("--max-kv-gib", type=float, default=32.0, help="skip sweep points whose KV cache exceeds this")
    p.add_argument("--json", dest="json_path", help="also write the results to this file")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="run on CPU with the torch reference at tiny sizes to check the harness (meaningless numbers)",
    )
    args = p.parse_args(argv)
    if args.num_q_heads % args.num_kv_heads:
        p.error("--num-q-heads must be a multiple of --num-kv-heads")
    if args.dry_run:
        args.batch_sizes = DRY_RUN_BATCHES
        args.context_lens = DRY_RUN_CONTEXTS
        args.prefill_batch_sizes = DRY_RUN_BATCHES
        args.prefill_lens = DRY_RUN_CONTEXTS
        args.num_q_heads, args.num_kv_heads, args.head_dim = 4, 2, 64
        args.impl, args.warmup, args.iters, args.copy_mib = "ref", 1, 2, 8
    return args


def time_ms(fn: Callable[[], object], warmup: int, iters: int, device: torch.device) -> float:
    """Mean milliseconds per call: CUDA events on a GPU, wall clock otherwise."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


def copy_bandwidth_gbps(mib: int, device: torch.device, warmup: int, iters: int) -> float:
    """Read + write GB/s of one large ``copy_`` between two buffers on ``device``."""
    n = mib * 2**20
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), warmup, iters, device)
    return 2 * n / (ms * 1e-3) / 1e9


def make_paged(batch, context, args, device, dtype, gen):
    """Random caches holding ``context`` tokens per sequence in shuffled blocks."""
    bs = args.block_size
    per_seq = -(-context // bs)
    total = batch * per_seq
    shape = (total, bs, args.num_kv_heads, args.head_dim)
    k_cache = torch.randn(shape, device=device, dtype=dtype, generator=gen)
    v_cache = torch.randn(shape, device=device, dtype=dtype, generator=gen)
    perm = torch.randperm(total, device=device, generator=gen)
    block_tables = perm.view(batch, per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return k_cache, v_cache, block_tables, seq_lens


def _kv_bytes(batch, context, args, dtype) -> int:
    return 2 * batch * context * args.num_kv_heads * args.head_dim * torch.finfo(dtype).bits // 8


def _impls(args, kind: str) -> list[tuple[str, Callable]]:
    table = {
        "decode": {"triton": paged_decode_attention_triton, "ref": paged_decode_attention_ref},
        "prefill": {"triton": paged_extend_attention_triton, "ref": paged_extend_attention_ref},
    }[kind]
    names = ["triton", "ref"] if args.impl == "both" else [args.impl]
    return [(n, table[n]) for n in names]


def bench_decode(args, device, dtype, copy_gbps) -> list[DecodeRow]:
    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    scale = args.head_dim**-0.5
    for batch in args.batch_sizes:
        for context in args.context_lens:
            kv_bytes = _kv_bytes(batch, context, args, dtype)
            if kv_bytes > args.max_kv_gib * 2**30:
                continue
            k_cache, v_cache, tables, seq_lens = make_paged(batch, context, args, device, dtype, gen)
            q = torch.randn(batch, args.num_q_heads, args.head_dim, device=device, dtype=dtype, generator=gen)
            for name, fn in _impls(args, "decode"):
                ms = time_ms(
                    lambda: fn(q, k_cache, v_cache, tables, seq_lens, scale, max_seq_len=context),
                    args.warmup, args.iters, device,
                )
                gbps = kv_bytes / (ms * 1e-3) / 1e9
                rows.append(DecodeRow(name, batch, context, ms, kv_bytes, gbps, gbps / copy_gbps))
            del k_cache, v_cache
    return rows


def causal_flops(q_len: int, context: int, num_q_heads: int, head_dim: int) -> float:
    """FLOPs of QK^T and PV for q_len queries at the end of a context: 4 * pairs * H * D."""
    prefix = context - q_len
    pairs = q_len * prefix + q_len * (q_len + 1) // 2
    return 4.0 * pairs * num_q_heads * head_dim


def bench_prefill(args, device, dtype) -> list[PrefillRow]:
    rows = []
    gen = torch.Generator(device=device).manual_seed(1)
    scale = args.head_dim**-0.5
    for batch in args.prefill_batch_sizes:
        for context in args.prefill_lens:
            if _kv_bytes(batch, context, args, dtype) > args.max_kv_gib * 2**30:
                continue
            k_cache, v_cache, tables, seq_lens = make_paged(batch, context, args, device, dtype, gen)
            q = torch.randn(batch * context, args.num_q_heads, args.head_dim, device=device, dtype=dtype, generator=gen)
            qsl = torch.arange(0, (batch + 1) * context, context, dtype=torch.int32, device=device)
            flops = batch * causal_flops(context, context, args.num_q_heads, args.head_dim)
            for name, fn in _impls(args, "prefill"):
                extra = {"max_query_len": context} if name == "triton" else {}
                ms = time_ms(
                    lambda: fn(q, k_cache, v_cache, tables, qsl, seq_lens, scale, **extra),
                    args.warmup, args.iters, device,
                )
                rows.append(PrefillRow(name, batch, context, ms, flops, flops / (ms * 1e-3) / 1e12))
            del k_cache, v_cache
    return rows


def format_report(device_name: str, copy_gbps: float, decode: list[DecodeRow], prefill: list[PrefillRow]) -> str:
    lines = [f"device: {device_name}", f"copy bandwidth (read+write): {copy_gbps:8.1f} GB/s", ""]
    lines.append(f"{'decode':8s} {'batch':>6s} {'context':>8s} {'ms':>9s} {'GB/s':>9s} {'% copy':>7s}")
    for r in decode:
        lines.append(
            f"{r.impl:8s} {r.batch:6d} {r.context:8d} {r.ms:9.3f} {r.gbps:9.1f} {100 * r.fraction_of_copy:6.1f}%"
        )
    lines += ["", f"{'prefill':8s} {'batch':>6s} {'context':>8s} {'ms':>9s} {'TFLOP/s':>9s}"]
    for r in prefill:
        lines.append(f"{r.impl:8s} {r.batch:6d} {r.context:8d} {r.ms:9.3f} {r.tflops:9.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        device = torch.device("cpu")
        device_name = "cpu (dry run: torch reference, tiny sizes; figures are not meaningful)"
    elif torch.cuda.is_available():
        device = torch.device("cuda")
        device_name = torch.cuda.get_device_name(device)
    else:
        print(
            "bench/gpu_kernels.py measures GPU kernels and needs a CUDA device; none is available. "
            "CPU figures would say nothing about the kernels. Use --dry-run to check the harness.",
            file=sys.stderr,
        )
        return EXIT_NO_DEVICE
    dtype = DTYPES[args.dtype]
    with torch.inference_mode():
        copy_gbps = copy_bandwidth_gbps(args.copy_mib, device, args.warmup, args.iters)
        decode = bench_decode(args, device, dtype, copy_gbps)
        prefill = bench_prefill(args, device, dtype)
    print(format_report(device_name, copy_gbps, decode, prefill))
    if args.json_path:
        payload = {
            "device": device_name,
            "dry_run": args.dry_run,
            "dtype": args.dtype,
            "geometry": {
                "num_q_heads": args.num_q_heads,
                "num_kv_heads": args.num_kv_heads,
                "head_dim": args.head_dim,
                "block_size": args.block_size,
            },
            "copy_bandwidth_gbps": copy_gbps,
            "decode": [asdict(r) for r in decode],
            "prefill": [asdict(r) for r in prefill],
        }
        with open(args.json_path, "w") as f:
            json.dump(payload, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
