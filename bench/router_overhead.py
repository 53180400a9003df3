"""What the router adds per request, measured in isolation (docs/router.md quotes the output).

1. Upstream client: sequential small POSTs to a minimal loopback upstream with aiohttp
   (pooled ClientSession) and with httpx (pooled AsyncClient), the choice behind the proxy.
2. Decision cost of cache-aware routing: tokenize a chat prompt with the engines' own code
   (the default model's tokenizer and chat template), hash its blocks, look it up in an index
   holding 2 engines x 4096 blocks, run the policy. Prompt sizes 256, 1024, 4096 tokens.
   Then the policy alone (filters, scorers, pick) over 2 and 16 endpoints that carry load and,
   where this tree's ``Endpoint`` has them, measured rates: what the load model costs per pick.
3. Added latency: the same tiny request direct to a null engine (bench/null_engine.py: no
   model, answers at once) and through the router
   (round-robin and cache-aware with a real tokenizer), alternating, p50 and p99.
4. Streamed relay: 256-event streams (one event every 2 ms, so each is its own upstream read)
   through the round-robin router: the router thread's CPU time per relayed chunk, which is
   what per-chunk work on the hot path (e.g. the end-to-end TTFT/TPOT clock) adds to.

  .venv/bin/python bench/router_overhead.py          (run from outside the repository root)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import time

import aiohttp
import httpx
import psutil

from kvmesh.engine.kv.events import KVSnapshot
from kvmesh.engine.router.app import RouterApp, RouterSettings
from kvmesh.engine.router.cli import load_tokenizer
from kvmesh.engine.router.index import PrefixIndex
from kvmesh.engine.router.index import PrefixMatch
from kvmesh.engine.router.policies import Endpoint, RouteRequest, build_policy
from kvmesh.engine.router.prompt import CHAT, analyze
from kvmesh.engine.util.asgi import ServerThread
from null_engine import EXTRA, NullEngine


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def summary(xs: list[float]) -> dict[str, float]:
    return {"p50_ms": round(pct(xs, 50) * 1e3, 3), "p99_ms": round(pct(xs, 99) * 1e3, 3),
            "mean_ms": round(statistics.fmean(xs) * 1e3, 3)}


async def bench_clients(url: str, n: int) -> dict[str, dict[str, float]]:
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    out = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        lat = []
        for i in range(n + 50):
            t = time.perf_counter()
            async with s.post(url + "/v1/completions", data=body,
                              headers={"content-type": "application/json"}) as r:
                await r.read()
            if i >= 50:
                lat.append(time.perf_counter() - t)
        out["aiohttp"] = summary(lat)
    async with httpx.AsyncClient() as c:
        lat = []
        for i in range(n + 50):
            t = time.perf_counter()
            r = await c.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"})
            r.read()
            if i >= 50:
                lat.append(time.perf_counter() - t)
        out["httpx"] = summary(lat)
    return out


def bench_decision(tokenizer, n: int) -> dict[str, dict[str, float]]:
    words = ("the quick brown fox jumps over the lazy dog while the router hashes every block " * 400).split()
    index = PrefixIndex()
    policy = build_policy("cache-aware")
    endpoints = [dataclasses.replace(e, id=name) for e, name in zip(loaded_endpoints(2), ("a", "b"))]
    out = {}
    for target in (256, 1024, 4096):
        text = " ".join(words[:int(target * 0.8)])
        body = json.dumps({"messages": [{"role": "system", "content": text},
                                        {"role": "user", "content": "question?"}]}).encode()
        probe = analyze(CHAT, body, tokenizer)
        hashes = probe.hashes(16, EXTRA)
        for e in ("a", "b"):
            index.reset(e, KVSnapshot(1, e, {"gpu": frozenset(hashes[: len(hashes) // (2 if e == "a" else 1)])}))
        tok, hsh, rest = [], [], []
        for _ in range(n):
            t0 = time.perf_counter()
            info = analyze(CHAT, body, tokenizer)
            t1 = time.perf_counter()
            hs = info.hashes(16, EXTRA)
            t2 = time.perf_counter()
            matches = index.longest_prefix(hs)
            policy.choose(RouteRequest(info.num_prompt_tokens, 16, matches), endpoints, 0)
            t3 = time.perf_counter()
            tok.append(t1 - t0)
            hsh.append(t2 - t1)
            rest.append(t3 - t2)
        out[f"{probe.num_prompt_tokens}_tokens"] = {"tokenize_ms": summary(tok)["p50_ms"],
                                                    "hash_ms": summary(hsh)["p50_ms"],
                                                    "index_and_policy_ms": summary(rest)["p50_ms"]}
    return out


def loaded_endpoints(n: int) -> list[Endpoint]:
    """``n`` endpoints with running requests, queued prefill and (if the tree has the fields)
    measured rates, all different, so no pick is a tie."""
    has_rates = "prefill_s_per_token" in {f.name for f in dataclasses.fields(Endpoint)}
    out = []
    for i in range(n):
        rates = {"prefill_s_per_token": 0.002 + 1e-4 * i, "decode_s_per_seq": 0.01 + 1e-3 * i} if has_rates else {}
        out.append(Endpoint(f"e{i}", running=i % 5, queued_prefill_tokens=97 * i, **rates))
    return out


def bench_policy(n: int) -> dict[str, dict[str, float]]:
    """Microseconds per ``Policy.choose`` of the cache-aware policy, the prefix matches given."""
    out = {}
    for policy_name in ("cache-aware", "least-load"):
        policy = build_policy(policy_name)
        for count in (2, 16):
            eps = loaded_endpoints(count)
            matches = {e.id: PrefixMatch(8 * i, {"gpu": 8 * i}, 8.0 * i) for i, e in enumerate(eps)}
            req = RouteRequest(1500, 16, matches)
            lat = []
            for turn in range(n + 100):
                t = time.perf_counter()
                policy.choose(req, eps, turn)
                if turn >= 100:
                    lat.append(time.perf_counter() - t)
            out[f"{policy_name}_{count}_endpoints"] = {"p50_us": round(pct(lat, 50) * 1e6, 2),
                                                        "p99_us": round(pct(lat, 99) * 1e6, 2)}
    return out


def bench_added_latency(engine_url: str, router_url: str, n: int) -> dict[str, dict[str, float]]:
    body = {"prompt": "hi", "max_tokens": 1}
    direct, routed = [], []
    with httpx.Client() as c:
        for i in range(n + 50):
            for url, acc in ((engine_url, direct), (router_url, routed)):
                t = time.perf_counter()
                c.post(url + "/v1/completions", json=body).raise_for_status()
                if i >= 50:
                    acc.append(time.perf_counter() - t)
    d, r = summary(direct), summary(routed)
    return {"direct": d, "router": r, "added_p50_ms": round(r["p50_ms"] - d["p50_ms"], 3),
            "added_p99_ms": round(r["p99_ms"] - d["p99_ms"], 3)}


def thread_cpu_s(native_id: int) -> float:
    for t in psutil.Process().threads():
        if t.id == native_id:
            return t.user_time + t.system_time
    raise LookupError(f"no thread {native_id}")


def bench_stream(engine_url: str, router: ServerThread, n: int, chunks: int) -> dict[str, object]:
    """Streams of ``chunks`` paced events (so each is its own upstream read) through the router:
    the router thread's CPU time per relayed chunk, and the wall time per stream."""
    body = {"prompt": "hi", "max_tokens": chunks, "stream": True}
    walls, cpu, relayed = [], 0.0, 0
    with httpx.Client(timeout=60) as c:
        for i in range(n + 2):
            before = thread_cpu_s(router.thread.native_id)
            t = time.perf_counter()
            got = 0
            with c.stream("POST", router.url + "/v1/completions", json=body) as r:
                for part in r.iter_raw():
                    got += part.count(b"\n\n")
            if i >= 2:
                walls.append(time.perf_counter() - t)
                cpu += thread_cpu_s(router.thread.native_id) - before
                relayed += got
    return {"chunks_per_stream": chunks, "streams": n, "wall": summary(walls),
            "router_cpu_us_per_chunk": round(cpu / relayed * 1e6, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--stream-requests", type=int, default=20)
    ap.add_argument("--only-stream", action="store_true", help="run only section 4")
    ap.add_argument("--only-decision", action="store_true", help="run only section 2")
    args = ap.parse_args()
    results: dict[str, object] = {}
    if args.only_decision:
        results["decision_p50"] = bench_decision(load_tokenizer("default"), 200)
        results["policy_choose"] = bench_policy(args.requests * 10)
        print(json.dumps(results, indent=2))
        return 0
    if not args.only_stream:
        engine = ServerThread(NullEngine()).start()
        results["upstream_client"] = asyncio.run(bench_clients(engine.url, args.requests))
        tokenizer = load_tokenizer("default")
        results["decision_p50"] = bench_decision(tokenizer, 200)
        results["policy_choose"] = bench_policy(args.requests * 10)
        for policy in ("round-robin", "cache-aware"):
            app = RouterApp(RouterSettings(policy=policy, engines=(engine.url,)), tokenizer)
            router = ServerThread(app).start()
            try:
                results[f"added_latency_{policy}"] = bench_added_latency(engine.url, router.url, args.requests)
            finally:
                router.stop()
        engine.stop()
    streamer = ServerThread(NullEngine(chunks=256, interval_s=0.002)).start()
    router = ServerThread(RouterApp(RouterSettings(policy="round-robin", engines=(streamer.url,)))).start()
    try:
        results["streamed_relay_round-robin"] = bench_stream(streamer.url, router, args.stream_requests, 256)
    finally:
        router.stop()
        streamer.stop()
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
