"""Open-loop serving benchmark of `kvmesh serve` with a chat workload.

For each request rate, requests arrive as a Poisson process (exponential
inter-arrival times from a seeded generator) and are sent when they are due,
whether or not earlier ones have finished (open loop). Each is a streaming
chat completion with a prompt of a fixed number of tokens and a fixed number
of output tokens (`ignore_eos`), so rates are comparable. Reported per rate:
TTFT and TPOT p50/p90/p99, end-to-end latency, output token throughput, and
the server's own TTFT histogram mean over the same window.

`--guidellm PATH` cross-checks one rate with GuideLLM (a load generator we did
not write; install it into its own virtual environment, see docs/benchmarks.md)
using the same prompt/output token counts, rate and request count.

Examples:
  python bench/serving.py --launch --rates 0.25,0.5,1,2 --num-requests 40
  python bench/serving.py --url http://127.0.0.1:8000 --rates 1 --guidellm /opt/guidellm/bin/guidellm
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from kvmesh.engine.util.metrics import parse_samples, sample_value
from kvmesh.engine.util.localproc import NotReady, ProcessExited, free_port, wait_ready

# Run as a script, bench/ is on sys.path.
from batch_check import burst, offline_throughput  # noqa: E402
from chat_client import RequestResult, send_chat  # noqa: E402
from loadtool import crosscheck_table, run_guidellm, tokenizer_dir  # noqa: E402

_WORDS = ("river stone light garden window paper music orange silver market winter bridge forest signal "
          "engine harbor lantern meadow canyon pepper velvet thunder marble compass rocket island "
          "quiet bright gentle rapid ancient hidden golden narrow simple curious").split()
_QUESTIONS = ["Summarize the notes above in two sentences.", "What is the main topic of the notes above?",
              "Write a short title for the notes above.", "List three keywords from the notes above."]


# ---- workload ----------------------------------------------------------------------------------------


def load_tokenizer(model: str):
    from kvmesh.engine.model.fetch import ensure_default_model
    from kvmesh.engine.model.tokenizer import Tokenizer

    if model == "default":
        return Tokenizer.from_gguf(ensure_default_model())
    path = Path(model)
    return Tokenizer.from_gguf(path) if path.suffix == ".gguf" else Tokenizer.from_dir(path)


def make_prompt(tokenizer, rng: random.Random, num_tokens: int) -> str:
    """User content of `num_tokens` tokens: random notes, then a question.

    Cutting token ids and decoding may not round-trip through the tokenizer at
    the cut, so a few cut points are tried; the first that re-encodes to
    exactly `num_tokens` wins (servers report the real count in `usage`).
    """
    question = rng.choice(_QUESTIONS)
    words: list[str] = []
    while True:
        text = "Notes: " + " ".join(words) + "\n" + question
        ids = tokenizer.encode(text)
        if len(ids) >= num_tokens + 8:
            break
        words.extend(rng.choice(_WORDS) for _ in range(max(1, (num_tokens + 8 - len(ids)) // 2)))
    best = tokenizer.decode(ids[-num_tokens:])  # keep the question at the end
    for start in range(len(ids) - num_tokens, max(-1, len(ids) - num_tokens - 8), -1):
        cand = tokenizer.decode(ids[start:start + num_tokens])
        if len(tokenizer.encode(cand)) == num_tokens:
            return cand
    return best


def poisson_arrivals(rate: float, n: int, rng: random.Random) -> list[float]:
    """Send times (seconds from start) of n requests arriving at `rate` per second."""
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of a non-empty list."""
    s = sorted(values)
    if not s:
        return math.nan
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


# ---- one rate -----------------------------------------------------------------------------------------


@dataclass
class RateResult:
    rate: float
    num_requests: int
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    output_tok_s: float
    ttft_s: dict[str, float] = field(default_factory=dict)
    tpot_s: dict[str, float] = field(default_factory=dict)
    e2e_s: dict[str, float] = field(default_factory=dict)
    server_ttft_mean_s: float = math.nan
    prompt_tokens_mean: float = math.nan
    errors: list[str] = field(default_factory=list)


def _pcts(values: list[float]) -> dict[str, float]:
    vals = [v for v in values if not math.isnan(v)]
    return {f"p{q}": percentile(vals, q) for q in (50, 90, 99)} | {"mean": sum(vals) / len(vals)} if vals else {}


def _server_ttft(url: str) -> tuple[float, float]:
    s = parse_samples(httpx.get(url + "/metrics", timeout=30).text)
    return (sample_value(s, "kvmesh_time_to_first_token_seconds_sum") or 0.0,
            sample_value(s, "kvmesh_time_to_first_token_seconds_count") or 0.0)


async def run_rate(url: str, model: str, prompts: list[str], rate: float, max_tokens: int, seed: int) -> RateResult:
    arrivals = poisson_arrivals(rate, len(prompts), random.Random(seed))
    ttft_sum0, ttft_n0 = _server_ttft(url)
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600, connect=30), limits=limits) as client:
        start = time.perf_counter()

        async def at(t: float, prompt: str) -> RequestResult:
            await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
            return await send_chat(client, url, model, prompt, max_tokens)

        results = await asyncio.gather(*(at(t, p) for t, p in zip(arrivals, prompts)))
    end = max((r.done for r in results if r.ok), default=time.perf_counter())
    ttft_sum1, ttft_n1 = _server_ttft(url)
    ok = [r for r in results if r.ok]
    duration = end - start
    return RateResult(
        rate=rate, num_requests=len(prompts), completed=len(ok), failed=len(results) - len(ok),
        duration_s=duration, request_throughput=len(ok) / duration,
        output_tok_s=sum(r.output_tokens for r in ok) / duration,
        ttft_s=_pcts([r.ttft for r in ok]), tpot_s=_pcts([r.tpot for r in ok]),
        e2e_s=_pcts([r.done - r.sent for r in ok]),
        server_ttft_mean_s=(ttft_sum1 - ttft_sum0) / (ttft_n1 - ttft_n0) if ttft_n1 > ttft_n0 else math.nan,
        prompt_tokens_mean=sum(r.prompt_tokens for r in ok) / len(ok) if ok else math.nan,
        errors=sorted({r.error for r in results if not r.ok})[:5],
    )


# ---- reporting ----------------------------------------------------------------------------------------


def machine_info() -> dict:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "loadavg_at_start": os.getloadavg()}


def table(rows: list[RateResult]) -> str:
    head = ("| rate (req/s) | done | req/s | out tok/s | TTFT p50/p90/p99 (s) | TPOT p50/p90/p99 (ms) | "
            "e2e p50 (s) | server TTFT mean (s) |\n|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        t, p = r.ttft_s, r.tpot_s
        lines.append(
            f"| {r.rate:g} | {r.completed}/{r.num_requests} | {r.request_throughput:.2f} | {r.output_tok_s:.1f} | "
            f"{t.get('p50', math.nan):.2f} / {t.get('p90', math.nan):.2f} / {t.get('p99', math.nan):.2f} | "
            f"{p.get('p50', math.nan) * 1e3:.0f} / {p.get('p90', math.nan) * 1e3:.0f} / "
            f"{p.get('p99', math.nan) * 1e3:.0f} | {r.e2e_s.get('p50', math.nan):.2f} | {r.server_ttft_mean_s:.2f} |")
    return "\n".join(lines)


# ---- server -----------------------------------------------------------------------------------------------


def server_log(port: int) -> Path:
    return Path(tempfile.gettempdir()) / f"kvmesh-bench-serve-{port}.log"


def launch_server(flags: list[str], port: int, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`kvmesh serve` on 127.0.0.1:``port``, ready when this returns; its output in ``server_log(port)``.
    ``env``: the process's environment (default: this one's)."""
    cmd = [sys.executable, "-m", "kvmesh.engine.server", "--host", "127.0.0.1", "--port", str(port), *flags]
    log = open(server_log(port), "wb")
    proc = subprocess.Popen(cmd, cwd=tempfile.gettempdir(), stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_ready(f"http://127.0.0.1:{port}/ready", 900, proc, Path(log.name), what="server")
    except (ProcessExited, NotReady):
        proc.kill()
        raise
    return proc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running kvmesh serve, e.g. http://127.0.0.1:8000")
    where.add_argument("--launch", action="store_true", help="start `kvmesh serve` on a free local port")
    ap.add_argument("--serve-flags", default="--dtype bfloat16", help="flags for the launched server")
    ap.add_argument("--model", default="default", help="model the server runs (to build exact-length prompts)")
    ap.add_argument("--rates", default="0.25,0.5,1,2", help="comma-separated request rates (req/s)")
    ap.add_argument("--num-requests", type=int, default=40, help="requests per rate")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (ignore_eos)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--guidellm", default=None, help="path to a guidellm executable for the cross-check")
    ap.add_argument("--crosscheck-rate", type=float, default=None, help="rate for the cross-check (default: "
                                                                         "the second of --rates)")
    ap.add_argument("--crosscheck-requests", type=int, default=120,
                    help="requests in the cross-check, for both tools (more requests, less sampling noise)")
    ap.add_argument("--batch-check", type=int, default=0, metavar="N",
                    help="also compare N simultaneous requests through the server with the offline engine "
                         "(needs --launch; the engine runs here first, then the server)")
    ap.add_argument("--out", default="bench/results/serving.json")
    args = ap.parse_args(argv)

    rates = [float(r) for r in args.rates.split(",")]
    tokenizer = load_tokenizer(args.model)
    offline = None
    if args.batch_check:
        if not args.launch:
            ap.error("--batch-check needs --launch (the offline engine must match the server's flags)")
        rng = random.Random(args.seed + 7)
        batch_prompts = [make_prompt(tokenizer, rng, args.prompt_tokens) for _ in range(args.batch_check)]
        offline = offline_throughput(_engine_flags(args.serve_flags, args.model), batch_prompts, args.max_tokens)
        print(f"offline engine, {args.batch_check} at once: {offline['output_tok_s']:.1f} out tok/s",
              file=sys.stderr)
    proc = None
    if args.launch:
        port = free_port()
        proc = launch_server(["--model", args.model, *args.serve_flags.split()], port)
        url = f"http://127.0.0.1:{port}"
    else:
        url = args.url.rstrip("/")
    try:
        served = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        info = {"machine": machine_info(), "url": url, "model": served, "serve_flags": args.serve_flags
                if args.launch else None, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                "num_requests": args.num_requests, "seed": args.seed, "command": " ".join(sys.argv)}
        # Warm up (first forward passes are slow) so the first rate is not penalized.
        asyncio.run(send_chat(httpx.AsyncClient(timeout=600), url, served, "Hello", 4))
        results = []
        for i, rate in enumerate(rates):
            rng = random.Random(args.seed * 1000 + i)
            prompts = [make_prompt(tokenizer, rng, args.prompt_tokens) for _ in range(args.num_requests)]
            r = asyncio.run(run_rate(url, served, prompts, rate, args.max_tokens, args.seed + i))
            results.append(r)
            print(f"rate {rate:g}: {r.completed}/{r.num_requests} ok, {r.output_tok_s:.1f} out tok/s, "
                  f"TTFT p50 {r.ttft_s.get('p50', math.nan):.2f}s, TPOT p50 "
                  f"{r.tpot_s.get('p50', math.nan) * 1e3:.0f}ms", file=sys.stderr)
        report: dict = {"info": info, "results": [asdict(r) for r in results]}
        print(table(results))
        if offline is not None:
            served_burst = asyncio.run(burst(url, served, batch_prompts, args.max_tokens))
            report["batch_check"] = {"num_requests": args.batch_check, "offline": offline, "server": served_burst,
                                     "ratio": served_burst["output_tok_s"] / offline["output_tok_s"]}
            print(f"{args.batch_check} requests at once: server {served_burst['output_tok_s']:.1f} out tok/s, "
                  f"offline engine {offline['output_tok_s']:.1f} (ratio {report['batch_check']['ratio']:.2f}); "
                  f"the client used {served_burst['client_cpu_s']:.1f} CPU-s of {served_burst['seconds']:.1f} s; "
                  f"event-loop lag per step: {served_burst['event_loop_lag']}")
        if args.guidellm:
            rate = args.crosscheck_rate or (rates[1] if len(rates) > 1 else rates[0])
            n = args.crosscheck_requests
            exe = shutil.which(args.guidellm) or args.guidellm
            rng = random.Random(args.seed * 1000 + 99)
            prompts = [make_prompt(tokenizer, rng, args.prompt_tokens) for _ in range(n)]
            ours = asyncio.run(run_rate(url, served, prompts, rate, args.max_tokens, args.seed + 99))
            g = run_guidellm(exe, url, served, tokenizer_dir(tokenizer), rate, n, args.prompt_tokens,
                             args.max_tokens, args.seed)
            report["crosscheck"] = {"rate": rate, "num_requests": n, "guidellm": g, "ours": asdict(ours)}
            print(crosscheck_table(rate, ours, g["summary"]))
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2))
        print(f"wrote {out}", file=sys.stderr)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(120)
    return 0


def _engine_flags(serve_flags: str, model: str) -> dict:
    """EngineConfig fields from the launched server's flags (those the engine itself uses)."""
    from kvmesh.engine.server.cli import add_serve_arguments, settings_from_args

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    cfg = settings_from_args(p.parse_args(["--model", model, *serve_flags.split()])).engine
    return {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}


if __name__ == "__main__":
    sys.exit(main())
