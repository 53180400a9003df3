"""fp32 products from block-quantized weights against oneDNN's fp32 GEMM, on the default model.

A decode step multiplies a few rows by every weight of the model once; the weights do not fit
in cache, so the step streams them from memory. This runs what a step's projections and LM
head do: every Q4_1/Q8_0 weight of the default model's GGUF (211 matrices, in file order),
for M rows at a time, once through kvmesh's kernel reading the file's blocks (4.5 / 8.5 bits
a weight, kernels/quant_rows.py) and once through oneDNN on the same weights dequantized to
fp32 and prepacked (what the engine ran before), interleaved, medians of --repeat passes.
Both compute the same matrix: the blocks dequantize to the fp32 weights bit for bit (checked
here for every matrix).

    taskset -c 1 .venv/bin/python bench/qlinear.py --threads 1
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
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(ensure_default_model(progress=False)))
    blocks, packed = [], []
    for t in reader.tensors:
        q = QuantRows.from_gguf(t.data, t.tensor_type.name)
        if q is None:
            continue
        w = torch.from_numpy(dequantize(t.data, t.tensor_type).copy())
        if not torch.equal(quant_rows.dequantize(q), w):
            raise SystemExit(f"{t.name}: the blocks do not dequantize to gguf's weights (or no native kernel)")
        blocks.append(q)
        packed.append(torch.ops.mkldnn._reorder_linear_weight(w, 64))
    op = torch.ops.mkldnn._linear_pointwise
    fp32_mb = sum(q.rows * q.cols * 4 for q in blocks) / 1e6
    print(f"{len(blocks)} matrices: {sum(q.nbytes for q in blocks) / 1e6:.0f} MB of blocks, {fp32_mb:.0f} MB in fp32",
          file=sys.stderr)

    rows_out = []
    print("| rows | blocks ms | oneDNN fp32 ms | speedup |\n|---|---|---|---|")
    for m in (int(r) for r in args.rows.split(",")):
        xs = {c: torch.randn(m, c) for c in {q.cols for q in blocks}}
        times: dict[str, list[float]] = {"blocks": [], "onednn": []}
        runs = {"blocks": lambda: [quant_rows.qlinear(xs[q.cols], q) for q in blocks],
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
    print(json.dumps({"cpu": cpu(), "threads": args.threads, "results": rows_out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
