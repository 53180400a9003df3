"""Where a step's time goes: the throughput benchmark's random workload, with timers
around the model's projections, LM head and native kernels.

Runs `--prefill-steps` steps from the start (the prompts' prefill chunks), then
`--warmup` more, then times `--decode-steps` decode-only steps, and prints the mean
milliseconds per step of each part. Timers add a little Python per call.

    python bench/step_profile.py
"""

from __future__ import annotations

import argparse
import collections
import time
from typing import Callable

from throughput import random_prompts

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.sampling import SamplingParams

PARTS = ("rms_norm", "rope_write_kv", "silu_mul", "_decode", "_extend", "_decode_step")


def instrument(eng: LLMEngine, acc: collections.Counter) -> None:
    def timed(key: str, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[key] += time.perf_counter() - t0
        return wrapper

    for name in PARTS:
        if getattr(eng.backend, name, None) is not None:
            setattr(eng.backend, name, timed(name.strip("_"), getattr(eng.backend, name)))
    for layer in eng.model.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            setattr(layer, name, timed("projections", getattr(layer, name)))
    eng.model.lm_head = timed("lm_head", eng.model.lm_head)


def report(title: str, acc: collections.Counter, seconds: float, steps: int) -> None:
    print(f"{title}: {1e3 * seconds / steps:.1f} ms per step over {steps} steps")
    for key, total in acc.most_common():
        print(f"  {key:14s} {1e3 * total / steps:8.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prefill-steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=14)
    ap.add_argument("--decode-steps", type=int, default=30)
    args = ap.parse_args()
    eng = LLMEngine(EngineConfig(dtype=args.dtype))
    acc: collections.Counter = collections.Counter()
    instrument(eng, acc)
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(random_prompts(64, 100, 300, eng.model_config.vocab_size, seed=0)):
        eng.add_request(str(i), prompt_token_ids=p, params=params)
    for title, n in (("prefill (2,048-token steps)", args.prefill_steps), (None, args.warmup),
                     ("decode (64 sequences)", args.decode_steps)):
        acc.clear()
        t0 = time.perf_counter()
        for _ in range(n):
            eng.step()
        if title:
            report(title, acc, time.perf_counter() - t0, n)


if __name__ == "__main__":
    main()
