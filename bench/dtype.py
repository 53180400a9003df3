"""Prefill and decode tok/s of the default model in float32 and bfloat16, side by side, and what
`--dtype auto` picks, on this CPU as it is and as a stand-in for a CPU without bf16 instructions:
oneDNN held to AVX512_CORE (`ONEDNN_MAX_CPU_ISA`) and kvmesh's native C kernels off (they are
compiled for the real CPU), so every bf16 op runs the way such a CPU runs it.

Each (ISA, dtype) runs in a fresh process, interleaved `--repeat` times; medians are reported.
Prefill: 4 cold prompts of 512 random tokens, max_tokens=1 (prompt tokens/s). Decode: 8 prompts of
16 tokens generating 128 each (generated tokens/s; the prefill is under 2% of the work).

    python bench/dtype.py --json bench/results/dtype.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time

ISAS = {"native": {}, "no-avx512-bf16": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "KVMESH_DISABLE_NATIVE_CPU": "1"}}
DTYPES = ("float32", "bfloat16")


def _one(dtype: str, threads: int) -> dict:
    import torch

    from kvmesh.engine.config import EngineConfig
    from kvmesh.engine.engine import LLMEngine
    from kvmesh.engine.llm import LLM
    from kvmesh.engine.sampling import SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(engine=LLMEngine(EngineConfig(dtype=dtype, device="cpu", num_threads=threads,
                                            enable_prefix_caching=False)))
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab) for _ in range(512)] for _ in range(4)]
    llm.generate([prompts[0][:64]], SamplingParams(max_tokens=2))  # warm up
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1))
    prefill = 4 * 512 / (time.perf_counter() - t)
    short = [[rng.randrange(100, vocab) for _ in range(16)] for _ in range(8)]
    t = time.perf_counter()
    outs = llm.generate(short, SamplingParams(max_tokens=128, ignore_eos=True))
    decode = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)
    return {"prefill_tok_s": prefill, "decode_tok_s": decode}


def _auto_pick() -> dict:
    from kvmesh.engine.dtype_choice import choose_dtype, cpu_flags

    c = choose_dtype("auto", "cpu", cpu_flags())
    return {"dtype": c.dtype, "reason": c.reason}


def _cpu() -> dict:
    model, flags = platform.processor(), []
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = [f for f in line.split(":", 1)[1].split() if "avx512" in f or "amx" in f]
                break
    except OSError:
        pass
    return {"model": model, "flags": flags, "cores": os.cpu_count()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_one(args.child, args.threads)))
        return
    runs: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.repeat):
        for isa, limit in ISAS.items():
            for dtype in DTYPES:
                env = {k: v for k, v in os.environ.items() if k not in ISAS["no-avx512-bf16"]} | limit
                out = subprocess.run([sys.executable, __file__, "--child", dtype, "--threads", str(args.threads)],
                                     env=env, capture_output=True, text=True, check=True)
                runs.setdefault((isa, dtype), []).append(json.loads(out.stdout.strip().splitlines()[-1]))
    table = {f"{isa}/{dtype}": {k: statistics.median(r[k] for r in rs) for k in rs[0]} for (isa, dtype), rs in runs.items()}
    result = {"cpu": _cpu(), "threads": args.threads, "auto": _auto_pick(), "median": table, "runs": {
        f"{i}/{d}": rs for (i, d), rs in runs.items()}}
    for isa in ISAS:
        f32, bf16 = table[f"{isa}/float32"], table[f"{isa}/bfloat16"]
        result.setdefault("bf16_over_fp32", {})[isa] = {k: bf16[k] / f32[k] for k in f32}
    print(f"CPU {result['cpu']['model']} ({' '.join(result['cpu']['flags'])}), {args.threads} threads; "
          f"auto picks {result['auto']['dtype']}: {result['auto']['reason']}")
    print(f"{'ISA':<16}{'dtype':<10}{'prefill tok/s':>14}{'decode tok/s':>14}")
    for key, row in table.items():
        isa, dtype = key.split("/")
        print(f"{isa:<16}{dtype:<10}{row['prefill_tok_s']:>14.0f}{row['decode_tok_s']:>14.1f}")
    for isa, ratio in result["bf16_over_fp32"].items():
        print(f"bf16/fp32 {isa}: prefill {ratio['prefill_tok_s']:.2f}x, decode {ratio['decode_tok_s']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
