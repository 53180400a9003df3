"""`kvmesh generate`: offline generation from the command line."""

from __future__ import annotations

import argparse
import sys
import time

from kvmesh.engine.config import EngineConfig


def add_generate_subcommand(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate offline (no server) from chat prompts")
    p.add_argument("prompts", nargs="*", default=["What is the capital of France?"],
                   help="user messages, each its own conversation")
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from kvmesh.engine.llm import LLM
    from kvmesh.engine.sampling import SamplingParams

    llm = LLM(EngineConfig(model=args.model, dtype=args.dtype))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    t0 = time.perf_counter()
    results = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    dt = time.perf_counter() - t0
    for prompt, r in zip(args.prompts, results):
        print(f">>> {prompt}\n{r.text}\n[{len(r.token_ids)} tokens, finish: {r.finish_reason}]\n")
    n = sum(len(r.token_ids) for r in results)
    print(f"{n} tokens in {dt:.2f}s ({n / dt:.1f} tok/s)", file=sys.stderr)
    return 0
