"""bf16 prefill (extend) attention: AMX tiles, torch's SDPA and the AVX-512 kernel, side by side.

The default model's shapes (9 query / 3 KV heads, head dim 64, blocks of 16 scattered through the
cache), one layer, one thread by default: chunks of new tokens after a cached prefix (what a
multi-turn conversation's next turn prefills) and whole prompts. For each shape and kernel: the
median of --repeat calls in ms, GFLOP/s (4 * D * heads per visible query-key pair), and the
largest difference from an fp64 oracle. The tiles column runs the AVX-512 kernel on CPUs without
AMX-BF16 (the wrapper's own fallback), so compare it on an AMX machine.

    taskset -c 1 .venv/bin/python bench/extend_attention.py
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from kvmesh.engine.kernels import cpu_native as nat
from kvmesh.engine.kernels.extend_attention import paged_extend_attention_ref

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gateway import cpu  # noqa: E402

HQ, HKV, D, BS = 9, 3, 64, 16
SHAPES = [  # (new tokens per sequence, context per sequence)
    ([64], [1200]), ([128], [1500]), ([96], [2000]), ([64, 100, 32], [1300, 1800, 1100]),
    ([512], [1536]), ([512], [512]), ([1024], [1024]), ([2048], [2048]),
]
KERNELS = {
    "tiles": nat.paged_extend_attention_cpu,
    "sdpa": functools.partial(nat.paged_extend_attention_cpu, bf16_sdpa=True, tiles=False),
    "avx512": functools.partial(nat.paged_extend_attention_cpu, tiles=False),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    blocks = max(len(ctx) * -(-max(ctx) // BS) for _, ctx in SHAPES) + 1
    k = torch.randn(blocks, BS, HKV, D, generator=g).bfloat16()
    v = torch.randn(blocks, BS, HKV, D, generator=g).bfloat16()
    rows = []
    heads = " | ".join(f"{n} ms (GF/s)" for n in KERNELS)
    print(f"| new tokens | context | {heads} | tiles vs sdpa | max error |")
    print("|---|---|" + "---|" * len(KERNELS) + "---|---|")
    for q_lens, ctx in SHAPES:
        q = torch.randn(sum(q_lens), HQ, D, generator=g).bfloat16()
        qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        lens = torch.tensor(ctx, dtype=torch.int32)
        order = torch.randperm(blocks, generator=g).to(torch.int32)  # scattered, as a pool in use
        width = max(-(-c // BS) for c in ctx)
        table = torch.stack([order[i * width:(i + 1) * width] for i in range(len(ctx))])
        call = (q, k, v, table, qsl, lens, D ** -0.5)
        oracle = paged_extend_attention_ref(q.double(), k.double(), v.double(), table, qsl, lens, D ** -0.5)
        flop = sum(n * (c - (n - 1) / 2) * 4 * D * HQ for n, c in zip(q_lens, ctx))
        ms, err = {}, 0.0
        for name, fn in KERNELS.items():
            err = max(err, float((fn(*call).double() - oracle).abs().max()))
            times = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                fn(*call)
                times.append((time.perf_counter() - t0) * 1e3)
            ms[name] = statistics.median(times)
        rows.append({"new_tokens": q_lens, "context": ctx, "ms": ms, "max_error": err})
        cells = " | ".join(f"{ms[n]:.2f} ({flop / ms[n] / 1e6:.0f})" for n in KERNELS)
        print(f"| {'+'.join(map(str, q_lens))} | {'+'.join(map(str, ctx))} | {cells} | "
              f"{ms['sdpa'] / ms['tiles']:.2f}x | {err:.1e} |", flush=True)
    info = {"cpu": cpu(), "threads": args.threads, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(info, indent=2))
    print(json.dumps({"cpu": info["cpu"], "threads": args.threads}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
