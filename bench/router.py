"""Routing policies side by side on a multi-turn chat trace: what cache-aware routing is for.

One invocation replays the same seeded, open-loop trace against:

* `single`: one engine with the whole machine (all cores, twice the per-engine KV budget),
  addressed directly: the fleet hit rate a perfectly shared cache would reach;
* for each policy (cache-aware, session, least-load, round-robin): `kvmesh up` with N engines
  (cores split evenly, the per-engine KV budget) behind `kvmesh router --policy P`.

Trace: C conversations of T turns; each opens on one of S long system prompts, and every turn
appends a user message and the model's reply, so the history grows. Conversations start as a
Poisson process; each next turn is sent a think time (exponential) after the previous reply
completes. Replies are greedy with `ignore_eos` and a fixed max_tokens, so every policy sees
identical prompts. Reported per system: TTFT/TPOT p50/p90/p99, output tok/s, the fleet prefix
hit rate (engines' `kvmesh_prefix_cache_hits_total / queries_total` over the run) and the
router's added latency at low load (tiny non-streaming requests, alternately direct to an
engine and through the router). `--json` also keeps every request's record under `requests`
(when it was sent, TTFT, TPOT, prompt and cached tokens), to see which requests make a tail.

  .venv/bin/python bench/router.py --json bench/results/router.json

`--baseline-tree PATH` also runs the cache-aware router from another checkout of kvmesh (its
engines and router import PATH first), right after this tree's: a before/after of a routing
change in one invocation, on the same trace and the same machine state.

`--guidellm PATH` also cross-checks one rate through the cache-aware router with GuideLLM (a
load generator we did not write, in its own virtual environment): the same single-turn
synthetic workload sent by bench/serving.py's client and by GuideLLM, one after the other.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from kvmesh.engine.util.metrics import parse_samples
from kvmesh.up import Supervisor, UpOptions, plan

# Run as a script, bench/ is on sys.path.
from chat_client import RequestResult, send_chat  # noqa: E402
from loadtool import crosscheck_table, run_guidellm, tokenizer_dir  # noqa: E402
from serving import load_tokenizer, make_prompt, percentile, run_rate  # noqa: E402

POLICIES = ("cache-aware", "session", "least-load", "round-robin")


@dataclass
class Conversation:
    cid: int
    start_s: float
    system: str
    users: list[str]
    think_s: list[float]


def make_trace(tokenizer, args: argparse.Namespace) -> list[Conversation]:
    rng = random.Random(args.seed)
    systems = [make_prompt(tokenizer, rng, rng.randint(args.system_tokens_min, args.system_tokens_max))
               for _ in range(args.system_prompts)]
    t, out = 0.0, []
    for cid in range(args.conversations):
        t += rng.expovariate(args.rate)
        users = [make_prompt(tokenizer, rng, rng.randint(args.user_tokens_min, args.user_tokens_max))
                 for _ in range(args.turns)]
        out.append(Conversation(cid, t, rng.choice(systems), users,
                                [rng.expovariate(1.0 / args.think_s) for _ in range(args.turns)]))
    return out


async def run_conversation(client: httpx.AsyncClient, url: str, model: str, conv: Conversation, t0: float,
                           max_tokens: int, results: list[RequestResult]) -> None:
    await asyncio.sleep(max(0.0, t0 + conv.start_s - time.perf_counter()))
    messages = [{"role": "system", "content": conv.system}]
    for turn, user in enumerate(conv.users):
        messages.append({"role": "user", "content": user})
        res = await send_chat(client, url, model, "", max_tokens, messages=list(messages),
                              headers={"x-session-id": f"conv-{conv.cid}"})
        res.label = f"conv {conv.cid} turn {turn}"
        results.append(res)
        if not res.ok:
            return  # the rest of this conversation depends on the reply
        messages.append({"role": "assistant", "content": res.text})
        await asyncio.sleep(conv.think_s[turn])


# Each engine's counters, by what they count: kvmesh's names and vLLM's (both count prompt tokens).
ENGINE_COUNTERS = {
    "queries": ("kvmesh_prefix_cache_queries_total", "vllm:prefix_cache_queries_total"),
    "hits": ("kvmesh_prefix_cache_hits_total", "vllm:prefix_cache_hits_total"),
    "preemptions": ("kvmesh_preemptions_total", "vllm:num_preemptions_total"),
}


def engine_counters(urls: list[str]) -> dict[str, float]:
    """ENGINE_COUNTERS summed over the engines at ``urls`` (every sample of each name)."""
    out = dict.fromkeys(ENGINE_COUNTERS, 0.0)
    for u in urls:
        samples = parse_samples(httpx.get(u + "/metrics", timeout=30).text)
        for key, names in ENGINE_COUNTERS.items():
            out[key] += sum(v for (n, _labels), v in samples.items() if n in names)
    return out


def _pcts(values: list[float]) -> dict[str, float]:
    vals = [v for v in values if v == v]
    return {f"p{q}": percentile(vals, q) for q in (50, 90, 99)} if vals else {}


@dataclass
class SystemResult:
    name: str
    requests: int
    failed: int
    duration_s: float
    output_tok_s: float
    ttft_s: dict[str, float]
    tpot_s: dict[str, float]
    fleet_hit_rate: float
    prompt_tokens: int
    cached_tokens_reported: int
    errors: list[str] = field(default_factory=list)
    router_rates: dict[str, dict[str, float]] = field(default_factory=dict)
    preemptions: int = 0
    """Sequences the engines preempted (recomputed later) for lack of KV blocks during the run."""


def request_records(raw: list) -> list[dict]:
    """Every request of a run in the order sent: its label, when it was sent (s after the first),
    TTFT, TPOT, prompt and cached tokens, and its error if it failed."""
    if not raw:
        return []
    t0 = min(r.sent for r in raw)
    return [{"label": r.label, "sent_s": round(r.sent - t0, 3), "ttft_s": round(r.ttft, 3),
             "tpot_ms": round(r.tpot * 1e3, 1), "prompt_tokens": r.prompt_tokens,
             "cached_tokens": r.cached_tokens, "error": r.error}
            for r in sorted(raw, key=lambda r: r.sent)]


async def replay(url: str, engine_urls: list[str], model: str, trace: list[Conversation], max_tokens: int,
                 name: str, raw: list[RequestResult] | None = None) -> SystemResult:
    """Replay ``trace`` against ``url``; ``raw``, when given, receives every request's result."""
    before = engine_counters(engine_urls)
    results: list[RequestResult] = [] if raw is None else raw
    limits = httpx.Limits(max_connections=len(trace) + 8, max_keepalive_connections=len(trace) + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(run_conversation(client, url, model, c, t0, max_tokens, results) for c in trace))
        duration = time.perf_counter() - t0
    delta = {k: v - before[k] for k, v in engine_counters(engine_urls).items()}
    ok = [r for r in results if r.ok]
    return SystemResult(
        name=name, requests=len(results), failed=len(results) - len(ok), duration_s=duration,
        output_tok_s=sum(r.output_tokens for r in ok) / duration,
        ttft_s=_pcts([r.ttft for r in ok]), tpot_s=_pcts([r.tpot for r in ok]),
        fleet_hit_rate=delta["hits"] / delta["queries"] if delta["queries"] > 0 else 0.0,
        prompt_tokens=sum(r.prompt_tokens for r in ok), cached_tokens_reported=sum(r.cached_tokens for r in ok),
        errors=sorted({r.error for r in results if not r.ok})[:5], preemptions=int(delta["preemptions"]))


async def added_latency(router_url: str, engine_url: str, model: str, n: int) -> dict[str, dict[str, float]]:
    """Latency of tiny non-streaming requests, alternately direct and through the router."""
    body = {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
    lat: dict[str, list[float]] = {"direct": [], "router": []}
    async with httpx.AsyncClient(timeout=60) as client:
        for base in (engine_url, router_url):  # warm both connections
            (await client.post(base + "/v1/completions", json=body)).raise_for_status()
        for _ in range(n):
            for key, base in (("direct", engine_url), ("router", router_url)):
                t = time.perf_counter()
                r = await client.post(base + "/v1/completions", json=body)
                lat[key].append(time.perf_counter() - t)
                r.raise_for_status()
    out = {k: _pcts(v) for k, v in lat.items()}
    out["added"] = {q: out["router"][q] - out["direct"][q] for q in ("p50", "p90", "p99")}
    return out


def router_rates(router_url: str) -> dict[str, dict[str, float]]:
    """The engine rates the router measured and scored with, at the end of a run (if exposed)."""
    s = parse_samples(httpx.get(router_url + "/metrics", timeout=30).text)
    out: dict[str, dict[str, float]] = {}
    for (name, labels), v in s.items():
        for metric, key in (("kvmesh_router_engine_prefill_seconds_per_token", "prefill_s_per_token"),
                            ("kvmesh_router_engine_decode_seconds_per_sequence", "decode_s_per_seq")):
            if name == metric:
                out.setdefault(dict(labels).get("engine", "?"), {})[key] = v
    return out


def router_decision_latency(router_url: str) -> dict[str, float]:
    s = parse_samples(httpx.get(router_url + "/metrics", timeout=30).text)
    total = count = 0.0
    for (name, _labels), v in s.items():
        if name == "kvmesh_router_decision_latency_seconds_sum":
            total += v
        elif name == "kvmesh_router_decision_latency_seconds_count":
            count += v
    return {"mean_s": total / count if count else float("nan"), "count": count}


def _row(r: SystemResult, single: SystemResult | None) -> str:
    rel = f" ({r.fleet_hit_rate / single.fleet_hit_rate:.0%} of single)" if single and single.fleet_hit_rate else ""
    t, p = r.ttft_s, r.tpot_s
    return (f"| {r.name} | {t.get('p50', 0):.2f} / {t.get('p90', 0):.2f} / {t.get('p99', 0):.2f} | "
            f"{p.get('p50', 0) * 1e3:.0f} / {p.get('p90', 0) * 1e3:.0f} / {p.get('p99', 0) * 1e3:.0f} | "
            f"{r.output_tok_s:.1f} | {r.fleet_hit_rate:.1%}{rel} | {r.requests - r.failed}/{r.requests} |")


def _crosscheck(args: argparse.Namespace, tokenizer, url: str, model: str) -> dict:
    """Our open-loop client, then GuideLLM, at one rate through the router (same workload shape)."""
    rng = random.Random(args.seed + 1)
    prompts = [make_prompt(tokenizer, rng, args.crosscheck_prompt_tokens) for _ in range(args.crosscheck_requests)]
    ours = asyncio.run(run_rate(url, model, prompts, args.crosscheck_rate, args.max_tokens, args.seed))
    theirs = run_guidellm(args.guidellm, url, model, tokenizer_dir(tokenizer), args.crosscheck_rate,
                          args.crosscheck_requests, args.crosscheck_prompt_tokens, args.max_tokens, args.seed)
    return {"ours": asdict(ours), "guidellm": theirs,
            "table": crosscheck_table(args.crosscheck_rate, ours, theirs["summary"])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--no-single", action="store_true", help="skip the single-engine reference")
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-prompts", type=int, default=4)
    ap.add_argument("--system-tokens-min", type=int, default=1024)
    ap.add_argument("--system-tokens-max", type=int, default=2048)
    ap.add_argument("--user-tokens-min", type=int, default=24)
    ap.add_argument("--user-tokens-max", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--rate", type=float, default=0.4, help="conversation starts per second")
    ap.add_argument("--think-s", type=float, default=2.0, help="mean pause between a reply and the next turn")
    ap.add_argument("--kv-cache-bytes", default="192MiB", help="KV budget of each of the N engines")
    ap.add_argument("--latency-requests", type=int, default=200)
    ap.add_argument("--base-port", type=int, default=18000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--guidellm", default=None, metavar="PATH", help="GuideLLM executable for the cross-check")
    ap.add_argument("--baseline-tree", default=None, metavar="PATH",
                    help="also run cache-aware with the kvmesh checkout at PATH (before/after in one invocation)")
    ap.add_argument("--crosscheck-rate", type=float, default=0.5)
    ap.add_argument("--crosscheck-requests", type=int, default=40)
    ap.add_argument("--crosscheck-prompt-tokens", type=int, default=128)
    args = ap.parse_args()

    tokenizer = load_tokenizer(args.model)
    trace = make_trace(tokenizer, args)
    served = "default" if args.model == "default" else args.model
    cores = os.cpu_count() or 1
    results: list[SystemResult] = []
    records: dict[str, list[RequestResult]] = {}  # each system's requests, for the JSON's "requests"
    latency: dict = {}
    crosscheck: dict = {}
    decision: dict = {}
    single: SystemResult | None = None
    log_root = Path(tempfile.mkdtemp(prefix="kvmesh-bench-router-"))
    from kvmesh.engine.util.cliargs import parse_size

    if not args.no_single:
        big = str(parse_size(args.kv_cache_bytes) * args.engines)
        specs = plan(UpOptions(engines=1, port=args.base_port, engine_base_port=args.base_port + 100,
                               kv_events_base_port=args.base_port + 200, model=args.model, threads=cores,
                               kv_cache_bytes=big), cores)
        with Supervisor(specs, log_root / "single", ready_timeout_s=900, out=sys.stderr):
            name = f"single engine ({cores} threads, {big} B KV), direct"
            single = asyncio.run(replay(specs[0].url, [specs[0].url], served, trace, args.max_tokens, name,
                                        raw=records.setdefault(name, [])))
            results.append(single)
            latency = asyncio.run(added_latency(specs[-1].url, specs[0].url, served, args.latency_requests))
            decision = router_decision_latency(specs[-1].url)
    runs = [(p, f"router {p}", None) for p in args.policies.split(",")]
    if args.baseline_tree:
        at = next((i + 1 for i, r in enumerate(runs) if r[0] == "cache-aware"), len(runs))
        runs.insert(at, ("cache-aware", "router cache-aware (baseline tree)", args.baseline_tree))
    for policy, name, tree in runs:
        specs = plan(UpOptions(engines=args.engines, port=args.base_port, engine_base_port=args.base_port + 100,
                               kv_events_base_port=args.base_port + 200, model=args.model, policy=policy,
                               kv_cache_bytes=args.kv_cache_bytes), cores)
        saved_path = os.environ.get("PYTHONPATH")
        if tree:  # the child processes import the other checkout first
            os.environ["PYTHONPATH"] = os.pathsep.join([tree] + ([saved_path] if saved_path else []))
        try:
            with Supervisor(specs, log_root / (policy + ("-baseline" if tree else "")), ready_timeout_s=900,
                            out=sys.stderr):
                engine_urls = [s.url for s in specs[:-1]]
                results.append(asyncio.run(replay(specs[-1].url, engine_urls, served, trace, args.max_tokens,
                                                  name, raw=records.setdefault(name, []))))
                results[-1].router_rates = router_rates(specs[-1].url)
                if results[-1].router_rates:
                    print(f"{name} measured engine rates: {results[-1].router_rates}", file=sys.stderr)
                if policy == "cache-aware" and not tree and args.guidellm:
                    crosscheck = _crosscheck(args, tokenizer, specs[-1].url, served)
        finally:
            if tree:
                if saved_path is None:
                    os.environ.pop("PYTHONPATH", None)
                else:
                    os.environ["PYTHONPATH"] = saved_path
        print(_row(results[-1], single), file=sys.stderr, flush=True)

    header = ["| system | TTFT p50/p90/p99 (s) | TPOT p50/p90/p99 (ms) | out tok/s | fleet prefix hit rate | ok |",
              "|---|---|---|---|---|---|"]
    print("\n".join(header + [_row(r, single) for r in results]))
    by = {r.name: r for r in results}
    rr = by.get("router round-robin")
    for name in ("router cache-aware", "router cache-aware (baseline tree)"):
        ca = by.get(name)
        if ca and rr and ca.ttft_s and rr.ttft_s:
            print(f"{name[7:]} vs round-robin TTFT p90: {rr.ttft_s['p90'] / ca.ttft_s['p90']:.2f}x lower")
    if latency:
        print(f"router added latency (tiny requests, {args.latency_requests} each way): "
              f"p50 {latency['added']['p50'] * 1e3:.2f} ms, p99 {latency['added']['p99'] * 1e3:.2f} ms; "
              f"router decision mean {decision.get('mean_s', float('nan')) * 1e3:.3f} ms")
    if crosscheck:
        print(crosscheck["table"])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "args": vars(args), "machine": {"cpus": cores, "python": platform.python_version()},
            "results": [asdict(r) for r in results], "added_latency_s": latency,
            "router_decision": decision, "crosscheck": crosscheck,
            "requests": {name: request_records(raw) for name, raw in records.items()}}, indent=2, default=str))
    return 0 if all(r.failed == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
