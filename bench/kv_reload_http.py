"""The reload a user sees: two ``kvmesh serve --cache-node`` engines sharing one ``kvmesh cache-node``
on this host, a long prompt sent to engine A (computed, written through), then to engine B (its
prefix fetched from the node). The client's time to first token on B is what counts; the cache
node's bytes moved over it is the end-to-end rate, set beside a loopback socket's in the same run.

Each repeat uses a new prompt (a fresh prefix) and, with ``--fresh-b``, a new engine B, so the
first request of a fresh engine is what is measured (the case of a pod that just scaled up); the
same prompt sent to B again (its own prefix cache now) is the compute floor, so TTFT minus that
floor is what the reload cost. ``--before DIR`` (a second checkout, e.g. the previous commit)
runs a second engine B from that tree beside this one's, alternating which goes first, reloading
the same prefix from the same node: before and after in one invocation.

    cd / && /work/main/.venv/bin/python /work/main/bench/kv_reload.py --http --fresh-b --dtype float32 \
        --tokens 6800 --repeat 3 --before /tmp/before
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from serving import launch_server, server_log

from kvmesh.engine.util.localproc import free_port
from kvmesh.engine.util.metrics import parse_samples, sample_value


@dataclass
class Engine:
    proc: subprocess.Popen
    url: str
    log: Path

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return sample_value(parse_samples(text), name, **labels) or 0.0


def start_engine(node_port: int, dtype: str, threads: int, blocks: int, extra: list[str],
                 tree: str | None = None) -> Engine:
    """``tree``: run the kvmesh package of that checkout (PYTHONPATH) instead of this one's."""
    port = free_port()
    flags = ["--model", "default", "--dtype", dtype, "--num-threads", str(threads), "--num-kv-blocks", str(blocks),
             "--cache-node", f"127.0.0.1:{node_port}", *extra]
    proc = launch_server(flags, port, env=dict(os.environ, **({"PYTHONPATH": tree} if tree else {})))
    return Engine(proc, f"http://127.0.0.1:{port}", server_log(port))


def stream_ttft(url: str, prompt: list[int]) -> tuple[float, int]:
    """(client TTFT in s, cached prompt tokens) of a streamed completion with ``max_tokens=1``."""
    body = {"model": "default", "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, cached = None, -1
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                first = time.perf_counter() - t0
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first is not None, "no token came back"
    return first, cached


def wait_stored(engine: Engine, blocks: float, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while engine.metric("kvmesh_kv_tier_stored_total", tier="remote") < blocks:
        if time.monotonic() > deadline:
            m = {k: engine.metric(f"kvmesh_kv_tier_{k}_total", tier="remote")
                 for k in ("stored", "dropped_saves", "failures")}
            raise RuntimeError(f"A wrote {m} blocks through of {blocks}; its log: {engine.log}")
        time.sleep(0.1)


def run_http(args, node_port: int, n: int, nbytes: int, vocab: int, sock_gbps: float, tokens) -> None:
    """Prints one row per repeat and tree, and the medians; ``tokens(n, seed, vocab)`` makes a prompt."""
    blocks = n // 16 + 64
    extra = ["--log-level", "warning"]
    trees = {"this tree": None, **({"before": args.before} if args.before else {})}
    a = start_engine(node_port, args.dtype, 1, blocks, extra)
    kept = {} if args.fresh_b else {k: start_engine(node_port, args.dtype, 1, blocks, extra, t)
                                    for k, t in trees.items()}
    rows: dict[str, list[tuple[float, float, int]]] = {k: [] for k in trees}
    computes = []
    try:
        for r in range(args.repeat):
            prompt = tokens(n, 9000 + r, vocab) + tokens(16, 17 + r, vocab)
            stored = a.metric("kvmesh_kv_tier_stored_total", tier="remote")
            t_a, _ = stream_ttft(a.url, prompt)
            computes.append(t_a)
            wait_stored(a, stored + n // 16)
            order = list(trees) if r % 2 == 0 else list(reversed(trees))
            for name in order:
                b = kept.get(name) or start_engine(node_port, args.dtype, 1, blocks, extra, trees[name])
                try:
                    t_b, cached = stream_ttft(b.url, prompt)
                    floor, _ = stream_ttft(b.url, prompt)  # the same prompt from B's own cache
                finally:
                    if args.fresh_b:
                        b.stop()
                rows[name].append((t_b, floor, cached))
                print(f"  run {r} {name}: A computed in {t_a:.2f} s; B reused {cached} of {n + 16} tokens, "
                      f"client TTFT {t_b * 1e3:.0f} ms (again from its own cache: {floor * 1e3:.0f} ms)", flush=True)
    finally:
        a.stop()
        for b in kept.values():
            b.stop()
    move = nbytes / sock_gbps / 1e9
    print(f"A's compute median {statistics.median(computes):.1f} s; the KV over the socket: {move * 1e3:.0f} ms")
    for name, got in rows.items():
        ttft = statistics.median(t for t, _, _ in got)
        floor = statistics.median(f for _, f, _ in got)
        cached = min(c for _, _, c in got)
        print(f"{name}: reload TTFT median {ttft * 1e3:.0f} ms (fewest cached {cached}), own-cache TTFT "
              f"{floor * 1e3:.0f} ms, reload cost {(ttft - floor) * 1e3:.0f} ms = "
              f"{(ttft - floor) / move:.1f}x the socket's transfer time; TTFT = {ttft / move:.1f}x it")
