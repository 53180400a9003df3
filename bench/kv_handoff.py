"""Prefill -> decode handoff: one push after the prefill vs pushes overlapped with later chunks.

Starts one decode engine and three prefill engines on the default model (one torch thread each): one
pushes each prompt block as soon as its chunk is computed (`--kv-transfer-overlap`, the default,
with the last chunk cut to a `--kv-transfer-tail-tokens` tail, default 128), one does the same
without the tail (`--kv-transfer-tail-tokens 0`), and one pushes everything after the first token
(`--no-kv-transfer-overlap`). For each prompt
length, stage 1 (reserve + prefill + transfer, docs/disagg.md) is timed on both, alternating, with
fresh random prompts (no prefix hits anywhere). Reports the medians of stage-1 latency and of the
transfer time left after the prefill (`transfer_s`: what the handoff adds to TTFT), and the ratio.

    cd / && /work/main/.venv/bin/python /work/main/bench/kv_handoff.py --json /work/main/bench/results/kv_handoff.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvmesh.engine.util.localproc import free_port, wait_ready


class Engine:
    def __init__(self, name: str, log_dir: Path, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_dir / f"{name}.log", "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvmesh", "serve", "--port", str(self.port),
                                      "--num-threads", "1", "--num-kv-blocks", "1024", *flags],
                                     stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 600) -> None:
        wait_ready(self.url + "/ready", timeout, self.proc, Path(self.log.name), what="engine")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def random_prompt(rng: random.Random, words: int) -> str:
    return " ".join(f"{rng.choice('bcdfghjklmnprstvz')}{rng.choice('aeiou')}{rng.randint(0, 999)}"
                    for _ in range(words))


def stage1(prefill: Engine, decode: Engine, transfer_port: int, tid: str, prompt: str) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 4, "temperature": 0,
            "kv_transfer_params": {"transfer_id": tid, "decode_host": "127.0.0.1", "decode_port": transfer_port}}
    t0 = time.perf_counter()
    r = httpx.post(prefill.url + "/v1/chat/completions", json=body, timeout=300)
    wall = time.perf_counter() - t0
    r.raise_for_status()
    doc = r.json()
    # Claim it so the decode engine's reservation is freed (the decode itself is not measured).
    claim = {k: v for k, v in body.items() if k != "kv_transfer_params"} | {"kv_transfer_params": {"transfer_id": tid}}
    httpx.post(decode.url + "/v1/chat/completions", json=claim, timeout=300).raise_for_status()
    return {"wall_s": wall, **doc}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--words", type=int, nargs="+", default=[250, 500, 1000],
                    help="prompt lengths in random words (about 3 tokens each)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=512, help="prefill engines' --max-num-batched-tokens")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="kvmesh-kv-handoff-"))
    decode = Engine("decode", log_dir, "--role", "decode")
    chunk = ["--max-num-batched-tokens", str(args.chunk)]
    systems = {"overlapped": Engine("prefill-overlap", log_dir, "--role", "prefill", *chunk),
               "overlapped, no tail": Engine("prefill-overlap-no-tail", log_dir, "--role", "prefill",
                                             "--kv-transfer-tail-tokens", "0", *chunk),
               "after prefill": Engine("prefill-whole", log_dir, "--role", "prefill", "--no-kv-transfer-overlap",
                                       *chunk)}
    engines = [decode, *systems.values()]
    rng = random.Random(0)
    rows = []
    try:
        for e in engines:
            e.wait_ready()
        port = httpx.get(decode.url + "/kv/info", timeout=10).json()["transfer_port"]
        for name, p in systems.items():  # warm up: connections, allocator
            stage1(p, decode, port, f"warm-{name}", random_prompt(rng, 50))
        for words in args.words:
            runs: dict[str, list[dict]] = {n: [] for n in systems}
            for i in range(args.repeat):
                for name, p in systems.items():
                    runs[name].append(stage1(p, decode, port, f"{words}-{i}-{name}", random_prompt(rng, words)))
            row = {"words": words, "prompt_tokens": runs["overlapped"][0]["prompt_tokens"]}
            for name, rs in runs.items():
                row[name] = {k: statistics.median(r[k] for r in rs)
                             for k in ("wall_s", "prefill_s", "transfer_s", "bytes_sent", "parts")}
            row["stage1_ratio"] = row["after prefill"]["wall_s"] / row["overlapped"]["wall_s"]
            rows.append(row)
            o, n, w = row["overlapped"], row["overlapped, no tail"], row["after prefill"]
            print(f"{row['prompt_tokens']:>5} tokens  stage 1: overlapped {o['wall_s'] * 1e3:7.1f} ms "
                  f"(transfer after prefill {o['transfer_s'] * 1e3:6.1f} ms, {o['parts']:.0f} parts) | "
                  f"no tail {n['wall_s'] * 1e3:7.1f} ms (transfer {n['transfer_s'] * 1e3:6.1f} ms, "
                  f"{n['parts']:.0f} parts) | after prefill {w['wall_s'] * 1e3:7.1f} ms (transfer "
                  f"{w['transfer_s'] * 1e3:6.1f} ms) | {row['stage1_ratio']:.2f}x  [{w['bytes_sent'] / 1e6:.1f} MB]",
                  flush=True)
    finally:
        for e in engines:
            e.stop()
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "repeat": args.repeat, "chunk": args.chunk,
                                               "cpus": os.cpu_count(), "load_after": os.getloadavg()}, indent=2))


if __name__ == "__main__":
    main()
