"""Where a step's time goes: the throughput benchmark's random workload, with timers
around the model's projections, LM head and native kernels.

Runs `--prefill-steps` steps from the start (the prompts' prefill chunks), then
`--warmup` more, then times `--decode-steps` decode-only steps, and prints the mean
milliseconds per step of each part. Timers add a little Python per call.

    python bench/step_profile.py

`--interference`: a decode step that shares its step with a prefill chunk. `--streams`
sequences decode; a cold `--long-prompt`-token prompt arrives; every step until its prefill ends
is timed with its parts, for each `--budgets` value of max_num_batched_tokens. The same prompt is
then prefilled alone on an idle engine, so each mixed step is set against the decode-only step
plus the chunk on its own: what a stream waits for, and what mixing itself costs.

    python bench/step_profile.py --interference --threads 1 --dtype float32

`--shared-decode`: decode-only steps of `--streams` sequences over 1, 2, 4 or `--streams` shared
prompts, the bf16 decode attention on the vector kernel against AMX tiles, alternating.

    python bench/step_profile.py --shared-decode --streams 15 --threads 1
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import time
from typing import Callable

import torch

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


def _timed_step(eng: LLMEngine, acc: collections.Counter) -> tuple[float, dict[str, float], list]:
    """One step: its seconds, its parts' seconds and its outputs."""
    acc.clear()
    t0 = time.perf_counter()
    outs = eng.step()
    return time.perf_counter() - t0, dict(acc), outs


def _decode_medians(eng: LLMEngine, acc: collections.Counter, args: argparse.Namespace) -> tuple[float, dict]:
    """Every queued prompt prefilled first (many long streams take more steps than --warmup), then
    --warmup decode steps, then --decode-steps timed ones: their median ms and each part's median s
    (the timings hold no prefill)."""
    while eng.scheduler.queued_prefill_tokens > 0:
        eng.step()
    for _ in range(args.warmup):
        eng.step()
    steps = [_timed_step(eng, acc) for _ in range(args.decode_steps)]
    ms = sorted(1e3 * t for t, _, _ in steps)[len(steps) // 2]
    return ms, {k: sorted(p.get(k, 0.0) for _, p, _ in steps)[len(steps) // 2] for k in steps[0][1]}


def _parts(parts: dict[str, float]) -> str:
    return ", ".join(f"{k} {1e3 * v:.1f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))


def interference(args: argparse.Namespace) -> None:
    """Decode steps against mixed steps (decodes + a prefill chunk) and the chunk alone."""
    from kvmesh.engine.model.loader import load_model

    dtype = getattr(torch, args.dtype)
    loaded = load_model("default", dtype)

    def engine(budget: int) -> LLMEngine:  # each engine takes its own copy of the weights dict
        eng = LLMEngine(EngineConfig(dtype=args.dtype, num_threads=args.threads, max_num_batched_tokens=budget,
                                     enable_prefix_caching=False),
                        loaded=dataclasses.replace(loaded, weights=dict(loaded.weights)))
        for t in eng.map_pools():  # as `kvmesh serve` does; finished before anything is timed
            t.join()
        return eng

    for budget in [int(b) for b in args.budgets.split(",")]:
        eng = engine(budget)
        acc: collections.Counter = collections.Counter()
        instrument(eng, acc)
        streams = random_prompts(args.streams, args.stream_prompt, args.stream_prompt, loaded.config.vocab_size, seed=1)
        long_prompt = random_prompts(1, args.long_prompt, args.long_prompt, loaded.config.vocab_size, seed=2)[0]
        params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(streams):
            eng.add_request(f"s{i}", prompt_token_ids=p, params=params)
        eng.step()  # requests reach the scheduler at a step
        dms, dparts = _decode_medians(eng, acc, args)
        print(f"budget {budget}: decode-only step ({args.streams} streams): median {dms:.1f} ms [{_parts(dparts)}]")
        eng.add_request("long", prompt_token_ids=long_prompt, params=SamplingParams(max_tokens=1, temperature=0.0))
        mixed = []
        done = False
        while not done:
            before = next((r.num_computed_tokens for r in eng.scheduler.running if r.request_id == "long"), 0)
            t, parts, outs = _timed_step(eng, acc)
            done = any(o.request_id == "long" and o.finished for o in outs)
            after = next((r.num_computed_tokens for r in eng.scheduler.running if r.request_id == "long"),
                         len(long_prompt))
            mixed.append((after - before, t, parts))
        # The same chunks with no decode beside them, on an idle engine of the same shape.
        alone = engine(budget)
        acc2: collections.Counter = collections.Counter()
        instrument(alone, acc2)
        alone.add_request("warm", prompt_token_ids=long_prompt[:64], params=SamplingParams(max_tokens=2))
        while alone.has_unfinished_requests():
            alone.step()
        alone.add_request("long", prompt_token_ids=long_prompt, params=SamplingParams(max_tokens=1, temperature=0.0))
        solo = []
        while alone.has_unfinished_requests():
            solo.append(_timed_step(alone, acc2))
        print("  step | chunk tokens | mixed ms | chunk alone ms | decode-only + alone ms | mixing overhead ms")
        for i, (n, t, parts) in enumerate(mixed):
            ta = solo[i][0] * 1e3 if i < len(solo) else float("nan")
            print(f"  {i:4d} | {n:12d} | {1e3 * t:8.1f} | {ta:14.1f} | {dms + ta:22.1f} | {1e3 * t - dms - ta:8.1f}")
            print(f"       mixed [{_parts(parts)}]")
            if i < len(solo):
                print(f"       alone [{_parts(solo[i][1])}]")
        total = sum(t for _, t, _ in mixed)
        worst = max(t for _, t, _ in mixed)
        print(f"  prefill of {len(long_prompt)} tokens: {len(mixed)} mixed steps, {1e3 * total:.0f} ms; "
              f"longest gap a stream sees {1e3 * worst:.0f} ms (decode-only {dms:.1f} ms)")


def shared_decode(args: argparse.Namespace) -> None:
    """Decode-only steps of --streams sequences opening on 1, 2, 4 or --streams shared 1,024-token
    prompts (a chat fleet's system prompts) plus 100-400 tokens of their own, with the bf16 decode
    attention on the vector kernel and on AMX tiles (where the CPU has AMX-BF16), alternating."""
    import functools

    from kvmesh.engine.kernels import cpu_native as nat
    from kvmesh.engine.model.loader import load_model

    loaded = load_model("default", getattr(torch, args.dtype))
    step_cpu = nat.decode_step_cpu
    for prefixes in sorted({1, 2, 4, args.streams}):
        for tiles in (False, True, False, True):
            nat.decode_step_cpu = functools.partial(step_cpu, tiles=tiles)  # the backend binds it at build
            eng = LLMEngine(EngineConfig(dtype=args.dtype, num_threads=args.threads),
                            loaded=dataclasses.replace(loaded, weights=dict(loaded.weights)))
            nat.decode_step_cpu = step_cpu
            for t in eng.map_pools():
                t.join()
            acc: collections.Counter = collections.Counter()
            instrument(eng, acc)
            g = torch.Generator().manual_seed(0)
            vocab = loaded.config.vocab_size
            system = [torch.randint(100, vocab, (1024,), generator=g).tolist() for _ in range(prefixes)]
            params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
            for i in range(args.streams):
                own = torch.randint(100, vocab, (int(torch.randint(100, 400, (1,), generator=g)),), generator=g)
                eng.add_request(f"s{i}", prompt_token_ids=system[i % prefixes] + own.tolist(), params=params)
                eng.step()  # one at a time: the first of a prompt caches it for the rest
            ms, parts = _decode_medians(eng, acc, args)
            print(f"{args.streams} streams over {prefixes} shared prompt(s), {'AMX tiles' if tiles else 'vector'}: "
                  f"decode-only step median {ms:.1f} ms [{_parts(parts)}]", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prefill-steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=14)
    ap.add_argument("--decode-steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--interference", action="store_true")
    ap.add_argument("--shared-decode", action="store_true",
                    help="decode steps over shared prompts, vector kernel against AMX tiles (bf16)")
    ap.add_argument("--streams", type=int, default=4, help="--interference: decoding sequences")
    ap.add_argument("--stream-prompt", type=int, default=1200, help="--interference: their prompt tokens")
    ap.add_argument("--long-prompt", type=int, default=1500, help="--interference: the arriving prompt")
    ap.add_argument("--budgets", default="2048,512,256", help="--interference: max_num_batched_tokens values")
    args = ap.parse_args()
    if args.interference:
        interference(args)
        return
    if args.shared_decode:
        shared_decode(args)
        return
    eng = LLMEngine(EngineConfig(dtype=args.dtype, num_threads=args.threads))
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
