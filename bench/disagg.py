"""Prefill/decode disaggregation against colocated engines on the same cores, under long-prompt
interference: does a separate prefill pool keep decode streams smooth (lower TPOT), and at what cost?

One invocation replays the same seeded, open-loop workload against each system, one after the
other, each started with the local platform (`kvmesh.up`: the processes `kvmesh up` runs, logs in
a temporary directory):

* A, disaggregated: `kvmesh up --prefill 1 --decode 1` behind the two-stage router
  (docs/disagg.md); the cores split evenly (1 torch thread per engine on 2 cores);
* A', the same as A with UCXPY_ENABLE_PYTHON_FUTURE=1 in every process's environment: ucxx then
  completes a pending receive through a future instead of a loop that yields with
  `asyncio.sleep(0)`, which otherwise keeps a decode engine's transfer thread busy (about one
  core) for as long as a prefill engine's connection is open (docs/benchmarks.md);
* B, colocated: `kvmesh up --engines 2` behind the cache-aware router, the same split.

Workload (docs/benchmarks.md states the defaults): two Poisson arrival streams over `--duration`
seconds, merged. Long requests have 2-4k-token prompts of random words (no shared prefixes beyond
the chat template) and a few output tokens; short requests have short prompts and long decodes
(`--short-max-tokens`), so long prefills land while decodes are running. Every request is a
streaming chat completion (greedy, `ignore_eos`, fixed max_tokens, usage included), timed on the
client: TTFT (send to first content chunk) and TPOT ((last - first chunk) / (tokens - 1)).
The workload and the SLO targets are the same for every system; each starts fresh, is warmed
up (a short and a 512-token request through each entry point), and is measured idle (three lone
short streams: the decode step at batch 1; CPU cores each process uses) before the workload.

Reported per system, overall and per class: TTFT and TPOT p50/p90/p99, throughput (requests and
output tokens per second, first send to last completion), goodput (requests per second that meet
both the TTFT target of their class and the TPOT target) and the ratios B/A (and B/A'). For A and A' also, from
the prefill engine's and the router's /metrics over the workload: KV handoffs by outcome, KV bytes
and push seconds per request (all parts of a handoff: with `--kv-transfer-overlap`, the engines'
default, blocks are pushed as their chunks complete), transfer GB/s, and the split of stage 1 (the
prefill side as the router sees it) into queue, prefill compute and the tail left after the first
token (what overlap did not hide); then, on the idle system, a probe of single stage-1 requests
sent by hand per the HTTP contract (prompt lengths `--probe-tokens`): KV bytes, parts, push time
and tail per request.

  cd / && /work/main/.venv/bin/python /work/main/bench/disagg.py --json /work/main/bench/results/disagg.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvmesh.engine.util.metrics import parse_samples
from kvmesh.up import Supervisor, UpOptions, plan

# Run as a script, bench/ is on sys.path.
from chat_client import RequestResult, send_chat  # noqa: E402
from serving import _pcts, load_tokenizer, machine_info, make_prompt, poisson_arrivals  # noqa: E402

KINDS = ("long", "short")


# ---- workload -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Planned:
    """One request of the trace: when it is sent (seconds from the start), its class and body."""

    at: float
    kind: str
    prompt_tokens: int
    max_tokens: int
    prompt: str = field(repr=False)


def arrivals_within(rate: float, duration: float, rng: random.Random) -> list[float]:
    """Poisson arrival times at `rate` per second that fall before `duration` seconds."""
    if rate <= 0 or duration <= 0:
        return []
    n = int(rate * duration * 2 + 20)  # far more than a Poisson count of mean rate*duration reaches
    return [t for t in poisson_arrivals(rate, n, rng) if t < duration]


def make_workload(tokenizer, args: argparse.Namespace) -> list[Planned]:
    """The seeded trace: the long and the short arrival streams merged in time order. Prompts are
    random words (`make_prompt`), each drawn afresh, so requests share no prefix but the chat
    template's."""
    rng = random.Random(args.seed)
    out: list[Planned] = []
    for kind, rate, lo, hi, max_tokens in (
            ("long", args.long_rate, args.long_tokens_min, args.long_tokens_max, args.long_max_tokens),
            ("short", args.short_rate, args.short_tokens_min, args.short_tokens_max, args.short_max_tokens)):
        for at in arrivals_within(rate, args.duration, rng):
            n = rng.randint(lo, hi)
            out.append(Planned(at, kind, n, max_tokens, make_prompt(tokenizer, rng, n)))
    return sorted(out, key=lambda p: p.at)


# ---- figures ------------------------------------------------------------------------------------


def meets_slo(r: RequestResult, ttft_target_s: float, tpot_target_s: float) -> bool:
    """A completed request whose TTFT and TPOT are both within their targets (a request of one
    output token has no TPOT and meets that target by definition)."""
    return r.ok and r.ttft <= ttft_target_s and (math.isnan(r.tpot) or r.tpot <= tpot_target_s)


def summarize(results: list[tuple[str, RequestResult]], start: float, ttft_slo: dict[str, float],
              tpot_slo: float) -> dict:
    """Latency percentiles, throughput and goodput of (kind, result) pairs sent from `start`, overall
    and per kind. Durations run from `start` to the last completion."""
    ok = [(k, r) for k, r in results if r.ok]
    end = max((r.done for _, r in ok), default=start)
    duration = max(end - start, 1e-9)

    def part(rows: list[tuple[str, RequestResult]]) -> dict:
        done = [r for _, r in rows if r.ok]
        good = sum(1 for k, r in rows if meets_slo(r, ttft_slo[k], tpot_slo))
        return {"requests": len(rows), "completed": len(done), "failed": len(rows) - len(done),
                "ttft_s": _pcts([r.ttft for r in done]), "tpot_s": _pcts([r.tpot for r in done]),
                "request_throughput": len(done) / duration,
                "output_tok_s": sum(r.output_tokens for r in done) / duration,
                "prompt_tokens_mean": sum(r.prompt_tokens for r in done) / len(done) if done else math.nan,
                "slo_met": good, "slo_attainment": good / len(rows) if rows else math.nan,
                "goodput_req_s": good / duration}

    # Streams decoding at once, on average: each completed request counts from its first to its
    # last token.
    decoding = sum(r.last - r.first for _, r in ok if r.output_tokens > 1) / duration
    out = {"duration_s": duration, "decode_concurrency": decoding, "all": part(results)}
    for kind in KINDS:
        out[kind] = part([(k, r) for k, r in results if k == kind])
    out["errors"] = sorted({r.error for _, r in results if not r.ok})[:5]
    return out


# ---- metrics ------------------------------------------------------------------------------------

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    return parse_samples(httpx.get(url + "/metrics", timeout=30).text)


def delta(before: Samples, after: Samples) -> Samples:
    """Counter and histogram samples' growth between two scrapes (gauges come out as differences too;
    callers read only counters, histogram sums and counts)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples named `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for (n, ls), v in samples.items():
        if n == name:
            key = dict(ls).get(label, "")
            out[key] = out.get(key, 0.0) + v
    return out


def _mean(samples: Samples, hist: str) -> tuple[float, float]:
    """(mean, count) of histogram `hist` over a delta."""
    s, c = total(samples, hist + "_sum"), total(samples, hist + "_count")
    return (s / c if c else math.nan), c


def disagg_figures(prefill: Samples, router: Samples) -> dict:
    """KV handoff and stage-1 figures of system A over the workload (deltas of /metrics)."""
    handoff_s, handoffs = _mean(prefill, "kvmesh_kv_handoff_seconds")
    kv_bytes = total(prefill, "kvmesh_kv_handoff_bytes_total")
    transfer_sum = total(prefill, "kvmesh_kv_handoff_seconds_sum")
    ttft_s, n_ttft = _mean(prefill, "kvmesh_time_to_first_token_seconds")
    queue_s, _ = _mean(prefill, "kvmesh_request_queue_time_seconds")
    stage1_s, n_stage1 = _mean(router, "kvmesh_router_pd_stage1_seconds")
    prompt_tokens = total(prefill, "kvmesh_prompt_tokens_total")
    compute_s = ttft_s - queue_s
    # What stage 1 adds after the first token: the last push part (earlier parts overlap with later
    # chunks' compute, --kv-transfer-overlap) and the HTTP answer.
    tail_s = stage1_s - ttft_s
    return {
        "handoffs_by_outcome": by_label(prefill, "kvmesh_kv_handoffs_total", "outcome"),
        "stage1_by_outcome": by_label(router, "kvmesh_router_pd_stage1_total", "outcome"),
        "fallbacks": by_label(router, "kvmesh_router_pd_fallback_total", "reason"),
        "restarts": by_label(router, "kvmesh_router_pd_restarts_total", "reason"),
        "decode_refusals": total(router, "kvmesh_router_pd_decode_refusals_total"),
        "queue_wait_count": total(router, "kvmesh_router_pd_queue_wait_seconds_count"),
        "blocks_sent": total(router, "kvmesh_router_pd_blocks_sent_total"),
        "decode_hit_blocks": total(router, "kvmesh_router_pd_decode_hit_blocks_total"),
        "kv_bytes_total": kv_bytes,
        "kv_bytes_per_handoff": kv_bytes / handoffs if handoffs else math.nan,
        "prompt_tokens_per_request": prompt_tokens / n_ttft if n_ttft else math.nan,
        # Push time summed over a handoff's parts (kvmesh_kv_handoff_seconds), whether or not it
        # overlapped with compute, and the rate it moved the bytes at.
        "transfer_s_per_handoff": handoff_s,
        "transfer_gb_s": kv_bytes / transfer_sum / 1e9 if transfer_sum else math.nan,
        "stage1": {
            "count": n_stage1, "mean_s": stage1_s,
            # The router's stage 1 split by the prefill engine's clock: arrival -> first scheduled
            # (the decode reservation and the queue), first scheduled -> first token (the prefill,
            # sharing steps with other prompts' chunks), then the tail: the push left after the
            # first token and the answer.
            "queue_s": queue_s, "prefill_compute_s": compute_s, "tail_s": tail_s,
            "tail_share": tail_s / stage1_s if stage1_s else math.nan,
            # Push time hidden behind compute: the parts' total less the exposed tail (approximate:
            # the tail includes the HTTP answer).
            "hidden_transfer_s": handoff_s - tail_s,
        },
    }


# ---- running one system -------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc; NaN elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return math.nan


def cpu_use(pids: dict[str, int], seconds: float) -> dict[str, float]:
    """Cores each process uses over the next `seconds` (1.0: one core busy all the time)."""
    before = {n: cpu_seconds(p) for n, p in pids.items()}
    time.sleep(seconds)
    return {n: (cpu_seconds(p) - before[n]) / seconds for n, p in pids.items()}


async def replay(url: str, model: str, trace: list[Planned]) -> tuple[list[tuple[str, RequestResult]], float]:
    limits = httpx.Limits(max_connections=len(trace) + 8, max_keepalive_connections=len(trace) + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0, connect=30), limits=limits) as client:
        start = time.perf_counter()

        async def one(p: Planned) -> tuple[str, RequestResult]:
            await asyncio.sleep(max(0.0, start + p.at - time.perf_counter()))
            return p.kind, await send_chat(client, url, model, p.prompt, p.max_tokens)

        return list(await asyncio.gather(*(one(p) for p in trace))), start


async def warm_up(urls: list[str], model: str, tokenizer, seed: int) -> None:
    """First forward passes (and, disaggregated, the first KV connection) are slow: one short and
    one 512-token request through each URL, prompts unlike the workload's."""
    rng = random.Random(seed + 99)
    async with httpx.AsyncClient(timeout=600) as client:
        for url in urls:
            for n in (16, 512):
                r = await send_chat(client, url, model, "Warm up: " + make_prompt(tokenizer, rng, n), 8)
                if not r.ok:
                    raise RuntimeError(f"warm-up request to {url} failed: {r.error}")


async def idle_stream(url: str, model: str, tokenizer, seed: int, n: int = 3) -> dict:
    """TPOT and TTFT of `n` lone short streams (128-token prompt, 64 tokens) one after the other on
    the idle system: the decode step at batch 1, the floor under the workload's TPOT."""
    rng = random.Random(seed + 98)
    async with httpx.AsyncClient(timeout=600) as client:
        rs = [await send_chat(client, url, model, make_prompt(tokenizer, rng, 128), 64) for _ in range(n)]
    if not all(r.ok for r in rs):
        raise RuntimeError(f"idle stream to {url} failed: {[r.error for r in rs if not r.ok]}")
    return {"tpot_s": _pcts([r.tpot for r in rs]), "ttft_s": _pcts([r.ttft for r in rs])}


def probe_transfers(prefill_url: str, decode_url: str, model: str, tokenizer, sizes: list[int],
                    seed: int) -> list[dict]:
    """Stage 1 by hand on the idle system (docs/disagg.md): per prompt length, the prefill engine's
    answer (bytes and blocks sent, reserve/prefill/transfer seconds); stage 2 then takes the KV over
    on the decode engine, so nothing is left held."""
    info = httpx.get(decode_url + "/kv/info", timeout=30).json()
    host = httpx.URL(decode_url).host
    rng = random.Random(seed + 2)
    out = []
    with httpx.Client(timeout=600) as client:
        for n in sizes:
            body = {"model": model, "messages": [{"role": "user", "content": make_prompt(tokenizer, rng, n)}],
                    "max_tokens": 2, "temperature": 0, "ignore_eos": True}
            tid = f"bench-{uuid.uuid4().hex}"
            m0 = scrape(prefill_url)
            t = time.perf_counter()
            r1 = client.post(prefill_url + "/v1/chat/completions", json={**body, "kv_transfer_params": {
                "transfer_id": tid, "decode_host": host, "decode_port": info["transfer_port"]}})
            stage1_s = time.perf_counter() - t
            r1.raise_for_status()
            r2 = client.post(decode_url + "/v1/chat/completions", json={**body, "kv_transfer_params": {
                "transfer_id": tid}})
            r2.raise_for_status()
            a = r1.json()
            row = {k: a.get(k) for k in ("prompt_tokens", "cached_tokens", "decode_hit_blocks", "blocks_sent",
                                         "bytes_sent", "parts", "reserve_s", "prefill_s", "transfer_s")}
            # transfer_s is what is left after the first token; the pushes' own time, parts
            # overlapped with compute included, is the growth of the handoff histogram.
            row["push_s"] = total(delta(m0, scrape(prefill_url)), "kvmesh_kv_handoff_seconds_sum")
            row["stage1_client_s"] = stage1_s
            row["push_gb_s"] = a["bytes_sent"] / row["push_s"] / 1e9 if row["push_s"] else math.nan
            out.append(row)
            print(f"  probe {a['prompt_tokens']} tokens: {a['bytes_sent'] / 1e6:.1f} MB in {row['parts']} parts, "
                  f"pushes {row['push_s']:.3f} s ({row['push_gb_s']:.3f} GB/s), after the first token "
                  f"{a['transfer_s']:.3f} s; prefill {a['prefill_s']:.2f} s", file=sys.stderr, flush=True)
    return out


def run_system(name: str, opts: UpOptions, env: dict[str, str], cores: int, log_dir: Path, trace: list[Planned],
               tokenizer, args: argparse.Namespace, ttft_slo: dict[str, float]) -> dict:
    specs = [dataclasses.replace(s, env={**s.env, **env}) for s in plan(opts, cores)]
    served = "default" if args.model == "default" else args.model
    router = specs[-1]
    engines = {s.name: s for s in specs[:-1]}
    print(f"== {name}: " + "; ".join(f"{s.name}: kvmesh {' '.join(s.args)}" for s in specs), file=sys.stderr,
          flush=True)
    with Supervisor(specs, log_dir, ready_timeout_s=900, out=sys.stderr) as sup:
        pids = {c.spec.name: c.proc.pid for c in sup.children}
        warm = [router.url] if opts.disaggregated else [s.url for s in engines.values()]
        asyncio.run(warm_up(warm, served, tokenizer, args.seed))
        idle = asyncio.run(idle_stream(router.url, served, tokenizer, args.seed))
        urls = {**{n: s.url for n, s in engines.items()}, "router": router.url}
        # Idle CPU after the warm-up (a disaggregated system has made KV transfers by now).
        idle_cpu = cpu_use(pids, 3.0)
        before = {n: scrape(u) for n, u in urls.items()}
        cpu0 = {n: cpu_seconds(p) for n, p in pids.items()}
        load0 = os.getloadavg()
        results, start = asyncio.run(replay(router.url, served, trace))
        load1 = os.getloadavg()
        wall = time.perf_counter() - start
        busy = {n: (cpu_seconds(p) - cpu0[n]) / wall for n, p in pids.items()}
        after = {n: scrape(u) for n, u in urls.items()}
        d = {n: delta(before[n], after[n]) for n in urls}
        summary = summarize(results, start, ttft_slo, args.tpot_slo)
        out = {"name": name, "disaggregated": opts.disaggregated,
               "processes": [{"name": s.name, "args": list(s.args), "env": s.env} for s in specs],
               "loadavg_before": load0, "loadavg_after": load1, "idle_stream": idle,
               "cpu_cores_idle": idle_cpu, "cpu_cores_under_load": busy,
               "decode_engines": sum(1 for n in engines if not n.startswith("prefill")), **summary,
               "engine_requests": {n: by_label(d[n], "kvmesh_requests_finished_total", "finish_reason")
                                   for n in engines},
               # Every request, to score other SLO targets later: (class, prompt and output tokens,
               # TTFT and TPOT in seconds, sent at, error).
               "requests": [{"kind": k, "ok": r.ok, "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
                             "ttft_s": r.ttft, "tpot_s": r.tpot, "sent_s": r.sent - start, "error": r.error}
                            for k, r in results]}
        if opts.disaggregated:
            out["disagg"] = disagg_figures(d["prefill-0"], d["router"])
            if args.probe_tokens:
                out["probe"] = probe_transfers(engines["prefill-0"].url, engines["decode-0"].url, served, tokenizer,
                                               [int(x) for x in args.probe_tokens.split(",")], args.seed)
    return out


# ---- report -------------------------------------------------------------------------------------


def _lat(d: dict, scale: float, fmt: str) -> str:
    return " / ".join(format(d.get(q, math.nan) * scale, fmt) for q in ("p50", "p90", "p99"))


def ratio(b: float, a: float) -> float:
    return b / a if a and not math.isnan(a) and not math.isnan(b) else math.nan


TABLE_HEAD = ["| system | class | ok | TTFT p50 / p90 / p99 (s) | TPOT p50 / p90 / p99 (ms) | req/s | out tok/s | "
              "SLO met | goodput (req/s) |", "|---|---|---|---|---|---|---|---|---|"]


def rows(s: dict) -> list[str]:
    out = []
    for kind in ("all", *KINDS):
        p = s[kind]
        out.append(f"| {s['name']} | {kind} | {p['completed']}/{p['requests']} | {_lat(p['ttft_s'], 1, '.2f')} | "
                   f"{_lat(p['tpot_s'], 1e3, '.0f')} | {p['request_throughput']:.3f} | {p['output_tok_s']:.1f} | "
                   f"{p['slo_attainment']:.0%} | {p['goodput_req_s']:.3f} |")
    return out


def table(*systems: dict) -> str:
    return "\n".join(TABLE_HEAD + [r for s in systems for r in rows(s)])


def ratios(a: dict, b: dict) -> dict[str, dict[str, float]]:
    """B/A per class: above 1 means the colocated system (B) is higher (slower for latencies)."""
    out: dict[str, dict[str, float]] = {}
    for kind in ("all", *KINDS):
        pa, pb = a[kind], b[kind]
        r = {f"ttft_{q}": ratio(pb["ttft_s"].get(q, math.nan), pa["ttft_s"].get(q, math.nan))
             for q in ("p50", "p90", "p99")}
        r |= {f"tpot_{q}": ratio(pb["tpot_s"].get(q, math.nan), pa["tpot_s"].get(q, math.nan))
              for q in ("p50", "p90", "p99")}
        r |= {"req_s": ratio(pb["request_throughput"], pa["request_throughput"]),
              "out_tok_s": ratio(pb["output_tok_s"], pa["output_tok_s"]),
              "goodput": ratio(pb["goodput_req_s"], pa["goodput_req_s"])}
        out[kind] = r
    return out


def ratio_table(r: dict[str, dict[str, float]]) -> str:
    cols = ("ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50", "tpot_p90", "tpot_p99", "req_s", "out_tok_s", "goodput")
    rows = ["| B/A | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for kind, v in r.items():
        rows.append(f"| {kind} | " + " | ".join(f"{v[c]:.2f}" for c in cols) + " |")
    return "\n".join(rows)


def system_line(s: dict) -> str:
    conc = s["decode_concurrency"]
    cpu = ", ".join(f"{n} {s['cpu_cores_idle'][n]:.2f}/{s['cpu_cores_under_load'][n]:.2f}" for n in s["cpu_cores_idle"])
    return (f"{s['name']}: idle lone stream TPOT {s['idle_stream']['tpot_s']['p50'] * 1e3:.0f} ms; under load "
            f"{conc:.1f} streams decoding at once on average, {conc / s['decode_engines']:.1f} "
            f"per decoding engine; cores used idle/under load: {cpu}; load average {s['loadavg_before'][0]:.2f} -> "
            f"{s['loadavg_after'][0]:.2f}")


def disagg_lines(a: dict) -> str:
    d = a["disagg"]
    s = d["stage1"]
    fallbacks = {k: v for k, v in d["fallbacks"].items() if v}
    restarts = {k: v for k, v in d["restarts"].items() if v}
    lines = [
        f"handoffs {d['handoffs_by_outcome']}, stage 1 {d['stage1_by_outcome']}, fallbacks {fallbacks}, "
        f"restarts {restarts}",
        f"KV per handoff {d['kv_bytes_per_handoff'] / 1e6:.1f} MB ({d['prompt_tokens_per_request']:.0f} prompt "
        f"tokens), transfer {d['transfer_s_per_handoff'] * 1e3:.0f} ms per handoff, {d['transfer_gb_s']:.3f} GB/s",
        f"stage 1 mean {s['mean_s']:.2f} s = queue {s['queue_s']:.2f} + prefill {s['prefill_compute_s']:.2f} + "
        f"tail after the first token {s['tail_s']:.3f} ({s['tail_share']:.1%} of stage 1); pushes "
        f"{d['transfer_s_per_handoff']:.3f} s per handoff, {s['hidden_transfer_s']:.3f} s of it behind compute",
    ]
    for p in a.get("probe", []):
        lines.append(f"probe (idle): {p['prompt_tokens']} tokens, {p['bytes_sent'] / 1e6:.1f} MB in {p['parts']} "
                     f"parts, prefill {p['prefill_s']:.2f} s, pushes {p['push_s'] * 1e3:.0f} ms "
                     f"({p['push_gb_s']:.3f} GB/s), after the first token {p['transfer_s'] * 1e3:.0f} ms")
    return "\n".join(lines)


def git_head() -> str:
    """The checkout's commit, with "+dirty" when tracked files differ from it ("" outside git)."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return head + ("+dirty" if head and dirty else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--duration", type=float, default=120.0, help="seconds over which requests arrive, per system")
    ap.add_argument("--long-rate", type=float, default=0.06, help="long-prompt arrivals per second")
    ap.add_argument("--long-tokens-min", type=int, default=2048)
    ap.add_argument("--long-tokens-max", type=int, default=4096)
    ap.add_argument("--long-max-tokens", type=int, default=32)
    ap.add_argument("--short-rate", type=float, default=0.25, help="short-prompt (decode stream) arrivals per second")
    ap.add_argument("--short-tokens-min", type=int, default=64)
    ap.add_argument("--short-tokens-max", type=int, default=256)
    ap.add_argument("--short-max-tokens", type=int, default=96)
    ap.add_argument("--ttft-slo-short", type=float, default=2.5, help="TTFT target of short requests (s)")
    ap.add_argument("--ttft-slo-long", type=float, default=20.0, help="TTFT target of long requests (s)")
    ap.add_argument("--tpot-slo", type=float, default=0.15, help="TPOT target of every request (s)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per engine (default: cores / 2)")
    ap.add_argument("--kv-cache-bytes", default=None, help="KV budget per engine (default: the engine's)")
    ap.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                    help="extra argument for every engine of both systems (repeatable)")
    ap.add_argument("--probe-tokens", default="512,1024,2048,4096",
                    help="prompt lengths of the idle stage-1 probe on system A ('' skips it)")
    ap.add_argument("--systems", default="disagg,disagg-ucx-future,colocated",
                    help="which systems to run, in order (of disagg, disagg-ucx-future, colocated)")
    ap.add_argument("--base-port", type=int, default=18600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    # SIGTERM unwinds like Ctrl-C, so every started process is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    tokenizer = load_tokenizer(args.model)
    trace = make_workload(tokenizer, args)
    cores = os.cpu_count() or 1
    ttft_slo = {"long": args.ttft_slo_long, "short": args.ttft_slo_short}
    counts = {k: sum(1 for p in trace if p.kind == k) for k in KINDS}
    print(f"trace: {counts} over {args.duration:g} s; "
          f"{sum(p.prompt_tokens for p in trace if p.kind == 'long')} long-prompt tokens", file=sys.stderr, flush=True)
    log_root = Path(tempfile.mkdtemp(prefix="kvmesh-bench-disagg-"))
    base = args.base_port
    common = dict(port=base, engine_base_port=base + 10, kv_events_base_port=base + 20,
                  kv_transfer_base_port=base + 40, model=args.model, threads=args.threads,
                  kv_cache_bytes=args.kv_cache_bytes, serve_args=tuple(args.serve_arg))
    # A decode engine's UCX listener port is not reusable at once after it stops (a variant run right
    # after another must not inherit it), so each system gets its own KV transfer ports.
    ucx_future = {"UCXPY_ENABLE_PYTHON_FUTURE": "1"}
    systems = {
        "disagg": ("A: disaggregated, 1 prefill + 1 decode", UpOptions(prefill=1, decode=1, **common), {}),
        "disagg-ucx-future": ("A': disaggregated, UCXPY_ENABLE_PYTHON_FUTURE=1",
                              UpOptions(prefill=1, decode=1, **common | {"kv_transfer_base_port": base + 45}),
                              ucx_future),
        "colocated": ("B: colocated, 2 engines", UpOptions(engines=2, policy="cache-aware", **common), {}),
    }
    started = time.time()
    machine = machine_info()  # its load average is the one at the start
    out: dict[str, dict] = {}
    for key in args.systems.split(","):
        name, opts, env = systems[key]
        out[key] = run_system(name, opts, env, cores, log_root / key, trace, tokenizer, args, ttft_slo)
        print(table(out[key]), file=sys.stderr, flush=True)
    report: dict = {"args": vars(args), "command": " ".join(sys.argv), "git": git_head(),
                    "machine": machine | {"loadavg_at_end": os.getloadavg()},
                    "wall_s": time.time() - started, "logs": str(log_root),
                    "trace": {"counts": counts, "prompt_tokens": {k: [p.prompt_tokens for p in trace if p.kind == k]
                                                                  for k in KINDS}},
                    "slo": {"ttft_s": ttft_slo, "tpot_s": args.tpot_slo}, "systems": out, "ratios": {}}
    print(table(*out.values()))
    b = out.get("colocated")
    for key, a in out.items():
        if not a["disaggregated"]:
            continue
        if b:
            r = report["ratios"][f"colocated/{key}"] = ratios(a, b)
            print(f"B / {a['name'].split(':')[0]}")
            print(ratio_table(r))
            print(f"TPOT p90 of the short streams (under long-prompt interference): {a['name'].split(':')[0]} "
                  f"{a['short']['tpot_s'].get('p90', math.nan) * 1e3:.0f} ms, B "
                  f"{b['short']['tpot_s'].get('p90', math.nan) * 1e3:.0f} ms")
        print(disagg_lines(a))
    for s in out.values():
        print(system_line(s))
    print(f"wall {report['wall_s']:.0f} s; load average at start {machine['loadavg_at_start'][0]:.2f}, at end "
          f"{os.getloadavg()[0]:.2f}; logs in {log_root}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return 0 if all(s["all"]["failed"] == 0 for s in out.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
