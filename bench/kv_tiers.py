"""TTFT of a request whose long prefix is recomputed vs reloaded from the host tier vs reloaded from a
cache node, and the host tier's cost when nothing hits. One invocation, side by side.

For each prefix length (default 2k, 4k, 8k tokens) a request = prefix + a short new suffix runs with
max_tokens=1, so its wall time is its TTFT:

* recompute: the prefix is nowhere (prefix cache reset);
* host tier: the prefix was computed, then evicted from the KV pool by another request of the same
  size into the engine's host tier (``--cpu-kv-bytes``);
* cache node: the prefix was computed and written through to a ``kvmesh cache-node`` process (over
  ucxx), then the engine's prefix cache was reset: only the node holds it.

Zero-hit overhead: decode throughput of unique prompts on a KV pool small enough that blocks are
evicted (and saved to the host tier) every step, tier on vs off, runs interleaved.

    cd / && /work/main/.venv/bin/python /work/main/bench/kv_tiers.py [--lengths 2048,4096,8192] [--repeat 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.llm import LLM
from kvmesh.engine.model.loader import load_model
from kvmesh.engine.sampling import SamplingParams
from kvmesh.engine.util.localproc import NotReady, ProcessExited, free_port_pair, wait_ready

SUFFIX = 16
TIER_SHARE: list[float] = []  # per tier-on run: share of wall time spent in the tier's own code


def start_node(memory: str) -> tuple[subprocess.Popen, int]:
    port = free_port_pair()
    exe = str(Path(sys.executable).with_name("kvmesh"))
    proc = subprocess.Popen([exe, "cache-node", "--memory", memory, "--host", "127.0.0.1", "--port", str(port),
                             "--ucx-port", str(port + 1), "--log-level", "warning"], cwd="/",
                            env=dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n"))
    try:
        wait_ready(f"http://127.0.0.1:{port}/ready", 60, proc, what="cache node")
    except (ProcessExited, NotReady):
        proc.kill()
        raise
    return proc, port


def tokens(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n,), generator=g).tolist()


def engine(loaded, **cfg) -> LLM:
    config = EngineConfig(model="default", dtype="bfloat16", device="cpu", **cfg)
    return LLM(engine=LLMEngine(config, loaded=dataclasses.replace(loaded, weights=dict(loaded.weights))))


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    t0 = time.perf_counter()
    res = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))[0]
    return time.perf_counter() - t0, res.num_cached_tokens


def wait_written(llm: LLM, blocks: int) -> None:
    remote = llm.engine.tiers.remote
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if remote.inflight_bytes == 0 and remote.snapshot_stats().stored >= blocks:
            return
        time.sleep(0.05)
    raise RuntimeError(f"write-through incomplete: {remote.snapshot_stats()}")


def bench_ttft(loaded, lengths: list[int], repeat: int, node_port: int, vocab: int) -> list[dict]:
    rows = []
    # The default model's context is 8192 tokens: an "8k" prefix leaves room for the suffix.
    cap = (loaded.config.max_position_embeddings - SUFFIX - 1) // 16 * 16
    lengths = [min(n, cap) for n in lengths]
    longest = max(lengths) + SUFFIX
    blocks = -(-longest // 16) + 8
    host = engine(loaded, num_kv_blocks=blocks, cpu_kv_bytes=2 * longest * 23_040 + (64 << 20))
    remote = engine(loaded, num_kv_blocks=blocks, cache_node=f"127.0.0.1:{node_port}", cache_node_timeout=60.0)
    deadline = time.monotonic() + 30
    while remote.engine._cache_node.clients() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    written = 0
    for n in lengths:
        rec, hst, rem = [], [], []
        for r in range(repeat):
            prefix = tokens(n, 1000 * n + r, vocab)
            ask = prefix + tokens(SUFFIX, 7 + r, vocab)
            # (a) recompute
            host.engine.kv.reset_prefix_cache()
            rec.append(ttft(host, ask)[0])
            # (b) host tier: compute the prefix, evict it with a filler of the same size, reload
            host.engine.kv.reset_prefix_cache()
            ttft(host, prefix + [5])
            ttft(host, tokens(longest - 1, 99 + r, vocab))  # evicts the prefix into the host tier
            t, cached = ttft(host, ask)
            assert cached >= n - 16, f"host tier reload covered only {cached} of {n} tokens"
            hst.append(t)
            # (c) cache node: compute + write through, forget locally, reload over ucxx
            remote.engine.kv.reset_prefix_cache()
            ttft(remote, prefix + [5])
            written += n // 16
            wait_written(remote, written)
            remote.engine.kv.reset_prefix_cache()
            t, cached = ttft(remote, ask)
            assert cached >= n - 16, f"cache node reload covered only {cached} of {n} tokens"
            rem.append(t)
        row = {"tokens": n, "recompute_s": statistics.median(rec), "host_s": statistics.median(hst),
               "node_s": statistics.median(rem), "bytes": n * 23_040}
        rows.append(row)
        print(f"{n:>6} tokens  recompute {row['recompute_s']:.3f} s  host tier {row['host_s']:.3f} s "
              f"({row['recompute_s'] / row['host_s']:.1f}x)  cache node {row['node_s']:.3f} s "
              f"({row['recompute_s'] / row['node_s']:.1f}x)", flush=True)
    remote.engine.close()
    return rows


def throughput(loaded, cpu_kv_bytes: int, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    llm = engine(loaded, num_kv_blocks=96, cpu_kv_bytes=cpu_kv_bytes, max_num_seqs=4)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    spent = [0.0]
    tiers = llm.engine.tiers
    if tiers is not None:  # time the tier's own work in the step (saves, loads, lookups' bookkeeping)
        def timed(fn):
            def run(*a):
                t = time.perf_counter()
                try:
                    return fn(*a)
                finally:
                    spent[0] += time.perf_counter() - t
            return run
        tiers.flush, tiers.on_evict, tiers.lookup = timed(tiers.flush), timed(tiers.on_evict), timed(tiers.lookup)
    t0 = time.perf_counter()
    res = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    TIER_SHARE.append(spent[0] / dt)
    n = sum(len(r.token_ids) + len(p) for r, p in zip(res, prompts))
    stored = llm.engine.tiers.host.stats.stored if llm.engine.tiers else 0
    if tiers is None:
        TIER_SHARE.pop()
    del llm, res, tiers
    gc.collect()  # the engine's callbacks form cycles: free its tensors before the next run
    return n / dt, stored


def bench_zero_hit(loaded, rounds: int, vocab: int) -> dict:
    prompts = [tokens(256, 5000 + i, vocab) for i in range(16)]
    on, off, stored = [], [], 0
    for r in range(rounds):
        for tier in ((0, 256 << 20) if r % 2 == 0 else (256 << 20, 0)):
            tps, s = throughput(loaded, tier, [p[:] for p in prompts], 32)
            (on if tier else off).append(tps)
            stored = max(stored, s)
    row = {"off_tps": statistics.median(off), "on_tps": statistics.median(on), "saved_blocks": stored}
    row["loss"] = 1 - row["on_tps"] / row["off_tps"]
    row["tier_share"] = statistics.median(TIER_SHARE)
    print(f"zero-hit: tier off {row['off_tps']:.1f} tok/s, on {row['on_tps']:.1f} tok/s "
          f"({100 * row['loss']:+.1f}% loss; {stored} blocks saved per run, no hits); runs off "
          f"{', '.join(f'{x:.0f}' for x in off)}, on {', '.join(f'{x:.0f}' for x in on)}; time in the tier's "
          f"code {100 * row['tier_share']:.2f}% of the run (median)", flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="2048,4096,8192")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--zero-hit-rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    loaded = load_model("default", torch.bfloat16)
    vocab = loaded.config.vocab_size
    print(f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}")
    proc, port = start_node("2GiB")
    try:
        bench_ttft(loaded, lengths, args.repeat, port, vocab)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(15)
    bench_zero_hit(loaded, args.zero_hit_rounds, vocab)
    print(f"load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
