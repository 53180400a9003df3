"""What constrained decoding costs: TPOT and throughput, unconstrained vs json_schema vs json_object.

One in-process engine on the default model (``--dtype auto``) runs batches of 1, 8 and 32 chat
requests three ways, interleaved per repeat so machine drift hits all three alike:
unconstrained (``ignore_eos``, so it runs as long as the constrained answers), a realistic
nested ``json_schema`` and ``json_object``. TPOT is each request's (last token - first token) /
(tokens - 1), median over requests; throughput is generated tokens / wall time. Also reported:
the first compile of the schema (what the first request with a new schema pays once) and the
share of constrained answers that parse and validate (the others ran into max_tokens inside a
value: finish_reason "length", never invalid JSON).

    .venv/bin/python bench/structured.py [--batches 1,8,32] [--max-tokens 64] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from structured_backends import NESTED, _cpu

QUESTIONS = ["Describe a person who lives in Paris as JSON.", "Make up a user profile for a bakery owner.",
             "Invent a customer record for a bike shop.", "Give a JSON profile of a retired teacher."]


def _valid(text: str, mode: str) -> bool:
    try:
        doc = json.loads(text)
    except ValueError:
        return False
    if mode == "json_object":
        return isinstance(doc, dict)
    if not isinstance(doc, dict) or not {"name", "age", "address", "role"} <= set(doc):
        return False
    return doc["role"] in ("admin", "user", "guest") and isinstance(doc["age"], int) and set(doc["address"]) == {
        "street", "city", "zip"}


def run(llm, batch: int, params, mode: str) -> dict:
    prompts = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(batch)]
    t0 = time.perf_counter()
    results = llm.chat(prompts, params)
    wall = time.perf_counter() - t0
    tpots = [(r.metrics.last_token_time - r.metrics.first_token_time) / (len(r.token_ids) - 1)
             for r in results if len(r.token_ids) > 1]
    tokens = sum(len(r.token_ids) for r in results)
    return {"tpot_ms": statistics.median(tpots) * 1e3, "tok_s": tokens / wall, "tokens": tokens / batch,
            "valid": sum(_valid(r.text, mode) for r in results) / batch}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()

    import torch

    from kvmesh.engine.config import EngineConfig
    from kvmesh.engine.llm import LLM
    from kvmesh.engine.sampling import SamplingParams
    from kvmesh.engine.structured.grammar import StructuredOutput

    llm = LLM(EngineConfig(model="default", max_num_seqs=32, enable_prefix_caching=False))
    grammars = llm.engine.grammars
    t0 = time.perf_counter()
    grammars.tokenizer  # noqa: B018 - the tokenizer's one-time import into the grammar engine
    t1 = time.perf_counter()
    schema = StructuredOutput.json_schema(NESTED, "response_format")
    grammars.prepare(schema)
    t2 = time.perf_counter()
    print(f"CPU: {_cpu()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"dtype {llm.engine.dtype}")
    print(f"grammar tokenizer built once per engine: {(t1 - t0) * 1e3:.0f} ms; "
          f"first compile of the nested schema: {(t2 - t1) * 1e3:.1f} ms")
    modes = {
        "unconstrained": SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True),
        "json_schema": SamplingParams(max_tokens=args.max_tokens, temperature=0.0, structured=schema),
        "json_object": SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                      structured=StructuredOutput("json_object")),
    }
    llm.chat([[{"role": "user", "content": "warm up"}]], modes["json_schema"])
    print(f"{'batch':>5} {'mode':>14} {'TPOT ms':>8} {'tok/s':>7} {'tokens':>6} {'parsed':>6} {'TPOT ratio':>10}")
    for batch in [int(b) for b in args.batches.split(",")]:
        rows: dict[str, list[dict]] = {m: [] for m in modes}
        for _ in range(args.repeat):
            for name, params in modes.items():
                rows[name].append(run(llm, batch, params, name))
        base = statistics.median(r["tpot_ms"] for r in rows["unconstrained"])
        for name, rs in rows.items():
            tpot = statistics.median(r["tpot_ms"] for r in rs)
            print(f"{batch:>5} {name:>14} {tpot:>8.2f} {statistics.median(r['tok_s'] for r in rs):>7.1f} "
                  f"{statistics.median(r['tokens'] for r in rs):>6.1f} "
                  f"{'' if name == 'unconstrained' else format(rs[-1]['valid'], '.0%'):>6} {tpot / base:>9.3f}x")


if __name__ == "__main__":
    main()
