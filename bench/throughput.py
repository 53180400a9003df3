"""Offline throughput: kvmesh vs transformers `generate`, side by side in one run.

Workload 1 (random): 64 prompts of 100-300 random token ids, 128 new tokens each,
greedy, ignore_eos. kvmesh gets all 64 requests at once; transformers gets them as
one left-padded batch. The two take turns `--repeat` times (a fresh kvmesh engine
each time, so nothing is served from an earlier run's cache); reports every run's
output tokens/s, the medians and the ratio of the medians.
Workload 2 (shared prefix): 64 requests sharing a 1,024-token prefix plus a short
unique suffix, with kvmesh's prefix caching on and off.

    python bench/throughput.py --json bench/results/throughput.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import statistics
import time

import torch

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.llm import LLM
from kvmesh.engine.sampling import SamplingParams


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the first ids (special tokens) so prompts look like text.
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_kvmesh(loaded, prompts, max_new: int, dtype: str, **cfg) -> dict:
    copy = dataclasses.replace(loaded, weights=dict(loaded.weights))
    llm = LLM(engine=LLMEngine(EngineConfig(dtype=dtype, **cfg), loaded=copy))
    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    t0 = time.perf_counter()
    res = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    out_tokens = sum(len(r.token_ids) for r in res)
    stats = llm.engine.stats()
    return {"seconds": dt, "output_tokens": out_tokens, "output_tok_s": out_tokens / dt,
            "cached_prompt_tokens": sum(r.num_cached_tokens for r in res),
            "steps": stats.num_steps, "preemptions": stats.num_preemptions}


def load_transformers(dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    from kvmesh.engine.model.fetch import ensure_default_model

    path = ensure_default_model(progress=False)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    return model


def run_transformers(model, prompts, max_new: int) -> dict:
    pad = 2
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.inference_mode():
        model.generate(ids[:1, -8:], attention_mask=mask[:1, -8:], max_new_tokens=2, do_sample=False,
                       pad_token_id=pad)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                             do_sample=False, pad_token_id=pad)
        dt = time.perf_counter() - t0
    n = (out.shape[1] - width) * out.shape[0]
    return {"seconds": dt, "output_tokens": n, "output_tok_s": n / dt}


def machine() -> dict:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--max-batched-tokens", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=3, help="alternating runs of the random workload")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-prefix", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from kvmesh.engine.model.loader import load_model

    dtype = EngineConfig(dtype=args.dtype).torch_dtype()
    loaded = load_model("default", dtype)
    vocab = loaded.config.vocab_size
    report: dict = {"machine": machine(), "args": vars(args)}

    prompts = random_prompts(args.num_prompts, 100, 300, vocab, seed=0)
    # Shared 2-core machines drift by several percent from minute to minute, so the two
    # systems take turns and each figure is a median over the repeats.
    hf_model = None if args.skip_hf else load_transformers(dtype)
    runs: dict[str, list[dict]] = {"kvmesh": [], "transformers": []}
    for r in range(args.repeat):
        km = run_kvmesh(loaded, prompts, args.max_new, args.dtype, max_num_batched_tokens=args.max_batched_tokens)
        runs["kvmesh"].append(km)
        print(f"random  run {r + 1}  kvmesh       {km['output_tok_s']:8.1f} tok/s  ({km['seconds']:.1f}s, "
              f"{km['steps']} steps)")
        if hf_model is not None:
            hf = run_transformers(hf_model, prompts, args.max_new)
            runs["transformers"].append(hf)
            print(f"random  run {r + 1}  transformers {hf['output_tok_s']:8.1f} tok/s  ({hf['seconds']:.1f}s)")
    report["random"] = {"runs": runs}
    for name, rs in runs.items():
        if rs:
            report["random"][name] = {"median_output_tok_s": statistics.median(x["output_tok_s"] for x in rs)}
    print(f"random  median kvmesh       {report['random']['kvmesh']['median_output_tok_s']:8.1f} tok/s")
    if hf_model is not None:
        hf_med = report["random"]["transformers"]["median_output_tok_s"]
        ratio = report["random"]["kvmesh"]["median_output_tok_s"] / hf_med
        pairs = [a["output_tok_s"] / b["output_tok_s"] for a, b in zip(runs["kvmesh"], runs["transformers"])]
        report["random"]["ratio"] = ratio
        report["random"]["ratio_per_run"] = pairs
        print(f"random  median transformers {hf_med:8.1f} tok/s")
        print(f"random  ratio of medians    {ratio:8.2f}x  (per run: {', '.join(f'{x:.2f}' for x in pairs)})")
        del hf_model

    if not args.skip_prefix:
        rng = random.Random(1)
        prefix = [rng.randrange(100, vocab) for _ in range(args.prefix_len)]
        shared = [prefix + [rng.randrange(100, vocab) for _ in range(rng.randint(16, 64))]
                  for _ in range(args.num_prompts)]
        on = run_kvmesh(loaded, shared, args.max_new, args.dtype, max_num_batched_tokens=args.max_batched_tokens)
        off = run_kvmesh(loaded, shared, args.max_new, args.dtype, max_num_batched_tokens=args.max_batched_tokens,
                         enable_prefix_caching=False)
        report["shared_prefix"] = {"caching_on": on, "caching_off": off,
                                   "ratio": on["output_tok_s"] / off["output_tok_s"]}
        print(f"prefix  caching on   {on['output_tok_s']:8.1f} tok/s  ({on['seconds']:.1f}s, "
              f"{on['cached_prompt_tokens']} cached prompt tokens)")
        print(f"prefix  caching off  {off['output_tok_s']:8.1f} tok/s  ({off['seconds']:.1f}s)")
        print(f"prefix  ratio        {report['shared_prefix']['ratio']:8.2f}x")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
