"""Products from block-quantized weights against oneDNN's GEMM, on the default model, in fp32 or bf16.

A decode step multiplies a few rows by every weight of the model once; the weights do not fit
in cache, so the step streams them from memory. This runs what a step's projections and LM
head do: every Q4_1/Q8_0 weight of the default model's GGUF (211 matrices, in file order),
for M rows at a time, once through kvmesh's kernel reading the file's blocks (4.5 / 8.5 bits
a weight, kernels/quant_rows.py) and once through oneDNN on the same weights dequantized to
fp32 (or rounded to bf16) and prepacked (what the engine runs for larger batches), interleaved,
medians of --repeat passes. Both compute the same matrix: the blocks dequantize to the weights
bit for bit (checked here for every matrix). bf16 from blocks runs on AMX tiles only.

    taskset -c 1 .venv/bin/python bench/qlinear.py --threads 1
    taskset -c 1 .venv/bin/python bench/qlinear.py --threads 1 --dtype bfloat16 --rows 1,4,8,16,32,64
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from gateway import cpu  # noqa: E402  (bench/ is on sys.path when run as a script)
from kvmesh.engine.kernels import quant_rows
from kvmesh.engine.kernels.quant_rows import QuantRows
from kvmesh.engine.model.fetch import ensure_default_model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,12,16,24,32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)

    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(ensure_default_model(progress=False)))
    blocks, products, packed = [], [], []
    for t in reader.tensors:
        q = QuantRows.from_gguf(t.data, t.tensor_type.name)
        if q is None:
            continue
        w = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).to(dtype)
        product = quant_rows.product(q)
        if not torch.equal(quant_rows.dequantize(q, dtype), w) or product is None \
                or product(torch.zeros(1, q.cols, dtype=dtype)) is None:
            raise SystemExit(f"{t.name}: the blocks do not dequantize to gguf's weights in {args.dtype}, "
                             "or no native kernel multiplies them here (bf16: AMX tiles)")
        blocks.append(q)
        products.append(product)
        packed.append(torch.ops.mkldnn._reorder_linear_weight(w, 64))
    op = torch.ops.mkldnn._linear_pointwise
    dense_mb = sum(q.rows * q.cols * dtype.itemsize for q in blocks) / 1e6
    print(f"{len(blocks)} matrices: {sum(q.nbytes for q in blocks) / 1e6:.0f} MB of blocks, {dense_mb:.0f} MB in "
          f"{args.dtype}", file=sys.stderr)

    rows_out = []
    print(f"| rows | blocks ms | oneDNN {args.dtype} ms | speedup |\n|---|---|---|---|")
    for m in (int(r) for r in args.rows.split(",")):
        xs = {c: torch.randn(m, c).to(dtype) for c in {q.cols for q in blocks}}
        times: dict[str, list[float]] = {"blocks": [], "onednn": []}
        runs = {"blocks": lambda: [f(xs[q.cols]) for q, f in zip(blocks, products)],
                "onednn": lambda: [op(xs[q.cols], p, None, "none", [], "") for q, p in zip(blocks, packed)]}
        for f in runs.values():
            f()  # warm
        for _ in range(args.repeat):
            for name, f in runs.items():
                t0 = time.perf_counter()
                f()
                times[name].append((time.perf_counter() - t0) * 1e3)
        b, d = statistics.median(times["blocks"]), statistics.median(times["onednn"])
        rows_out.append({"rows": m, "blocks_ms": b, "onednn_ms": d})
        print(f"| {m} | {b:.1f} | {d:.1f} | {d / b:.2f}x |", flush=True)
    print(json.dumps({"cpu": cpu(), "threads": args.threads, "dtype": args.dtype, "results": rows_out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
