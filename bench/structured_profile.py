"""Where a constrained decode step's extra time goes: bench/structured.py's batch, with timers.

Runs the same chat requests as bench/structured.py (default model, greedy) unconstrained and
with the nested ``json_schema``, interleaved per repeat, and times the pieces of every step in
which all ``--batch`` requests decode: the engine step, the runner's input preparation, the
forward pass, the LM head, the grammar pieces (mask fill on the worker thread, the step's wait
for it, the mask applied to the logits, the matchers advanced), sampling, and the rest of the
runner (the fp32 copy of the logits, Python). Prints the median over repeats of the mean
milliseconds per step of each piece, and the spread (min-max). Timers add a little Python.

    .venv/bin/python bench/structured_profile.py [--batch 8] [--max-tokens 96] [--repeat 5]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from typing import Callable

from structured import QUESTIONS
from structured_backends import NESTED, _cpu


def _timed(acc: collections.Counter, key: str, fn: Callable, gate: Callable[[], bool]) -> Callable:
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if gate():
                acc[key] += time.perf_counter() - t0
    return wrapper


def instrument(llm, acc: collections.Counter, batch: int) -> None:
    """Wrap the step's pieces; counts only steps where ``batch`` requests all decode."""
    import kvmesh.engine.runner as runner_mod

    eng, runner = llm.engine, llm.engine.runner
    state = {"on": False}

    def on() -> bool:
        return state["on"]

    orig_execute = runner.execute

    def execute(out, block_ids):
        state["on"] = out.num_decodes == len(out.seqs) == batch
        if state["on"]:
            acc["steps"] += 1
        t0 = time.perf_counter()
        try:
            return orig_execute(out, block_ids)
        finally:
            if state["on"]:
                acc["runner.execute"] += time.perf_counter() - t0

    runner.execute = execute
    orig_step = eng.step

    def step():
        t0 = time.perf_counter()
        try:
            return orig_step()
        finally:
            if state["on"]:
                acc["engine.step"] += time.perf_counter() - t0
            state["on"] = False

    eng.step = step
    runner.prepare = _timed(acc, "prepare", runner.prepare, on)
    runner.model.forward = _timed(acc, "forward", runner.model.forward, on)
    runner.model.compute_logits = _timed(acc, "lm_head", runner.model.compute_logits, on)
    runner_mod.sample = _timed(acc, "sample", runner_mod.sample, on)
    masks = runner.grammar_masks
    masks.start = _timed(acc, "mask.submit", masks.start, on)
    masks.advance = _timed(acc, "mask.advance", masks.advance, on)
    orig_fill = masks._fill

    def fill(*args, **kwargs):  # on the worker thread; counted when the step that asked counts
        counted = state["on"]
        t0 = time.perf_counter()
        try:
            return orig_fill(*args, **kwargs)
        finally:
            if counted:
                acc["mask.fill (worker)"] += time.perf_counter() - t0

    masks._fill = fill
    if hasattr(masks, "_fill_ahead"):  # the next step's masks, filled right after sampling
        orig_ahead = masks._fill_ahead

        def fill_ahead(*args, **kwargs):
            counted = state["on"]
            t0 = time.perf_counter()
            try:
                return orig_ahead(*args, **kwargs)
            finally:
                if counted:
                    acc["mask.fill ahead (worker)"] += time.perf_counter() - t0

        masks._fill_ahead = fill_ahead
    orig_apply = masks.apply

    def apply(logits, pending, *args, **kwargs):
        t0 = time.perf_counter()
        pending.result()
        t1 = time.perf_counter()
        orig_apply(logits, pending, *args, **kwargs)
        if state["on"]:
            acc["mask.wait"] += t1 - t0
            acc["mask.apply"] += time.perf_counter() - t1

    masks.apply = apply


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()

    import torch

    from kvmesh.engine.config import EngineConfig
    from kvmesh.engine.llm import LLM
    from kvmesh.engine.sampling import SamplingParams
    from kvmesh.engine.structured.grammar import StructuredOutput

    llm = LLM(EngineConfig(model="default", max_num_seqs=32, enable_prefix_caching=False))
    schema = StructuredOutput.json_schema(NESTED, "response_format")
    modes = {
        "unconstrained": SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True),
        "json_schema": SamplingParams(max_tokens=args.max_tokens, temperature=0.0, structured=schema),
    }
    print(f"CPU: {_cpu()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"dtype {llm.engine.dtype}; batch {args.batch}")
    llm.chat([[{"role": "user", "content": "warm up"}]], modes["json_schema"])
    acc: collections.Counter = collections.Counter()
    instrument(llm, acc, args.batch)
    prompts = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(args.batch)]
    per: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for _ in range(args.repeat):
        for name, params in modes.items():
            acc.clear()
            llm.chat(prompts, params)
            steps = acc.pop("steps", 0) or 1
            row = {k: 1e3 * v / steps for k, v in acc.items()}
            named = sum(v for k, v in row.items() if k not in ("engine.step", "runner.execute")
                        and "(worker)" not in k)
            row["runner rest (fp32 copy, Python)"] = row.get("runner.execute", 0.0) - named
            row["engine rest (scheduler, outputs)"] = row.get("engine.step", 0.0) - row.get("runner.execute", 0.0)
            row["steps counted"] = steps
            per[name].append(row)
    keys = list(dict.fromkeys(k for rows in per.values() for r in rows for k in r))
    print(f"{'ms per step (median, min-max)':36s}" + "".join(f"{m:>24s}" for m in modes) + f"{'delta':>9s}")
    for k in keys:
        cells, meds = [], []
        for m in modes:
            vals = [r.get(k, 0.0) for r in per[m]]
            med = statistics.median(vals)
            meds.append(med)
            cells.append(f"{med:8.3f} ({min(vals):6.2f}-{max(vals):6.2f})")
        print(f"{k:36s}" + "".join(f"{c:>24s}" for c in cells) + f"{meds[1] - meds[0]:+9.3f}")


if __name__ == "__main__":
    main()
