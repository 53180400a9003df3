"""Native CPU kernels against their torch references, side by side in one run.

Shapes are those of the default model (9 query / 3 KV heads, head dim 64, hidden
576, MLP 1,536) in bf16 with blocks of 16 scattered through the cache. Decode
attention runs over 30 layers' worth of cache so K/V come from DRAM, as in a real
decode step; the other kernels run on one warm input. Reports the best of a few
repetitions per kernel, in ms, and the ratio. A last comparison runs the native decode
kernel on sequences that share prefixes (four system prompts, interleaved in the batch as
a scheduler orders them) in batch order, grouped by prefix, and grouped on AMX tiles (the
default where the CPU has AMX-BF16; elsewhere that column repeats the vector kernel).

    python bench/cpu_kernels.py --json bench/results/cpu_kernels.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from kvmesh.engine.kernels import cpu_native as nat
from kvmesh.engine.kernels.activation import silu_mul_ref
from kvmesh.engine.kernels.decode_attention import paged_decode_attention_ref
from kvmesh.engine.kernels.extend_attention import paged_extend_attention_ref
from kvmesh.engine.kernels.rmsnorm import rms_norm_ref
from kvmesh.engine.kernels.rope import build_cos_sin_cache, rope_write_kv_ref

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gateway import cpu  # noqa: E402

HQ, HKV, D, BS, HIDDEN, INTER, LAYERS = 9, 3, 64, 16, 576, 1536, 30


def best_ms(fn: Callable[[], object], reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def paged(lens: list[int], layers: int, g: torch.Generator):
    """A [layers, 2, blocks, 16, HKV, D] cache and block tables scattering each sequence."""
    nbs = [-(-n // BS) for n in lens]
    total = sum(nbs) + 1
    kv = torch.randn(layers, 2, total, BS, HKV, D, generator=g).bfloat16()
    order = torch.randperm(total, generator=g)
    table = torch.zeros(len(lens), max(nbs), dtype=torch.int32)
    used = 0
    for i, nb in enumerate(nbs):
        table[i, :nb] = order[used:used + nb].to(torch.int32)
        used += nb
    return kv, table, torch.tensor(lens, dtype=torch.int32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not nat.native_available():
        raise SystemExit("the native kernels could not be built (no C compiler?)")
    g = torch.Generator().manual_seed(0)
    rows: list[dict] = []

    def row(name: str, ref: Callable[[], object], native: Callable[[], object], per: int = 1) -> None:
        r, n = best_ms(ref, args.reps) / per, best_ms(native, args.reps) / per
        rows.append({"kernel": name, "torch_ms": r, "native_ms": n, "speedup": r / n})
        print(f"{name:58s} torch {r:8.3f} ms  native {n:7.3f} ms  {r / n:5.1f}x")

    lens = torch.randint(200, 330, (64,), generator=g).tolist()
    kv, table, seq_lens = paged(lens, LAYERS, g)
    q = torch.randn(64, HQ, D, generator=g).bfloat16()

    def decode(fn):
        return lambda: [fn(q, kv[i, 0], kv[i, 1], table, seq_lens, D ** -0.5) for i in range(LAYERS)]

    row("decode attention, 64 seqs x 200-330 tokens, per layer (cold)",
        decode(paged_decode_attention_ref), decode(nat.paged_decode_attention_cpu), per=LAYERS)

    ext_lens = [190] * 11
    kv1, table1, seq1 = paged(ext_lens, 1, g)
    qsl = torch.tensor([0, *torch.tensor(ext_lens).cumsum(0).tolist()], dtype=torch.int32)
    qe = torch.randn(sum(ext_lens), HQ, D, generator=g).bfloat16()
    ext_args = (qe, kv1[0, 0], kv1[0, 1], table1, qsl, seq1, D ** -0.5)
    row("extend attention, 11 prefills of 190 tokens, per layer",
        lambda: paged_extend_attention_ref(*ext_args), lambda: nat.paged_extend_attention_cpu(*ext_args))

    for t in (64, 2048):
        x = torch.randn(t, HIDDEN, generator=g).bfloat16()
        res = torch.randn(t, HIDDEN, generator=g).bfloat16()
        w = torch.randn(HIDDEN, generator=g).bfloat16()
        row(f"RMSNorm + residual, {t} x {HIDDEN}",
            lambda: rms_norm_ref(x, w, 1e-5, res), lambda: nat.rms_norm_cpu(x, w, 1e-5, res))
        qkv = torch.randn(t, (HQ + 2 * HKV) * D, generator=g).bfloat16()
        qv = qkv[:, :HQ * D].view(t, HQ, D)
        kk = qkv[:, HQ * D:(HQ + HKV) * D].view(t, HKV, D)
        vv = qkv[:, (HQ + HKV) * D:].view(t, HKV, D)
        cos_sin = build_cos_sin_cache(D, 8192, 100000.0)
        pos = torch.randint(0, 8192, (t,), generator=g)
        kc, vc = kv1[0, 0].clone(), kv1[0, 1].clone()
        slots = torch.randperm(kc.shape[0] * BS, generator=g)[:t]
        row(f"RoPE + KV write, {t} tokens x {HQ + HKV} heads",
            lambda: rope_write_kv_ref(qv, kk, vv, pos, cos_sin, kc, vc, slots),
            lambda: nat.rope_write_kv_cpu(qv, kk, vv, pos, cos_sin, kc, vc, slots))
        gu = torch.randn(t, 2 * INTER, generator=g).bfloat16()
        row(f"SiLU * up, {t} x {INTER}", lambda: silu_mul_ref(gu), lambda: nat.silu_mul_cpu(gu))
    logits = torch.randn(64, 49152, generator=g).bfloat16()
    row("argmax, 64 x 49,152 bf16 logits (torch: upcast + argmax)",
        lambda: logits.float().argmax(dim=-1), lambda: nat.argmax_rows(logits))

    orders = prefix_order_rows(g, args.reps)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu(), "threads": torch.get_num_threads(), "rows": rows, "prefix_order": orders},
                      f, indent=2)


def shared_prefix_tables(seqs: int, blocks: int, groups: int, shared: int, g: torch.Generator) -> torch.Tensor:
    """Block tables for ``seqs`` sequences of ``blocks`` blocks each; sequence i starts with the
    ``shared`` blocks of prefix ``i % groups`` (none when groups == 0), the rest its own."""
    table = torch.zeros(seqs, blocks, dtype=torch.int32)
    own = torch.randperm(seqs * blocks, generator=g) + groups * shared  # scattered, as a pool in use
    k = shared if groups else 0
    for i in range(seqs):
        if k:
            table[i, :k] = torch.arange((i % groups) * shared, (i % groups + 1) * shared)
        table[i, k:] = own[i * blocks:(i + 1) * blocks - k]
    return table


def prefix_order_rows(g: torch.Generator, reps: int) -> list[dict]:
    """16 decoding sequences of 1,200 tokens over 30 layers, with 4 shared 1,008-token prefixes
    (63 blocks) or none: the native vector kernel in batch order and prefix-grouped, and the
    prefix-grouped AMX kernel."""
    seqs, ctx, groups, shared = 16, 1200, 4, 63
    blocks = -(-ctx // BS)
    kv = torch.randn(LAYERS, 2, groups * shared + seqs * blocks, BS, HKV, D, generator=g).bfloat16()
    q = torch.randn(seqs, HQ, D, generator=g).bfloat16()
    lens = torch.full((seqs,), ctx, dtype=torch.int32)
    out = []
    for name, n in (("no shared prefix", 0), ("4 shared prefixes, interleaved", groups)):
        table = shared_prefix_tables(seqs, blocks, n, shared, g)

        def step(grouped: bool, tiles: bool):
            return lambda: [nat.paged_decode_attention_cpu(q, kv[i, 0], kv[i, 1], table, lens, D ** -0.5,
                                                           group_prefixes=grouped, tiles=tiles)
                            for i in range(LAYERS)]
        plain, grouped = best_ms(step(False, False), reps), best_ms(step(True, False), reps)
        tiles = best_ms(step(True, True), reps)
        out.append({"case": name, "batch_order_ms": plain, "grouped_ms": grouped, "speedup": plain / grouped,
                    "tiles_ms": tiles, "tiles_speedup": plain / tiles})
        print(f"decode attention, 16 x {ctx} tokens, {name:32s} 30 layers: batch order {plain:6.1f} ms"
              f"  grouped {grouped:6.1f} ms ({plain / grouped:4.2f}x)"
              f"  grouped on AMX tiles {tiles:6.1f} ms ({plain / tiles:4.2f}x)")
    return out


if __name__ == "__main__":
    main()
