"""A long prefix reloaded from a cache node, end to end: its KV's rate to the first token against a
plain loopback socket's rate in the same run.

One engine (default model, this process) computes a ``--tokens`` prefix and writes it through to a
``kvmesh cache-node`` process; its prefix cache is then reset, so only the node holds the prefix,
and the prefix + a 16-token suffix runs with ``max_tokens=1`` (its wall time is its TTFT). The
same request with the prefix still in the engine's own cache gives the compute floor (the suffix's
forward over the long context); the difference is what moving the KV cost:

    move rate = KV bytes / (TTFT reloaded - TTFT with a local hit)

and the engine's own record of the fetch (asked -> bytes in this process) is printed beside it, as
it does not depend on two noisy TTFTs.

``--path lane`` (default: both processes on one host take the same-host lane) or ``--path ucx``
(lanes off on both sides: UCX over TCP, the path between hosts). The socket row moves the same
bytes between two processes over loopback TCP (bench/kv_transfer.py's ``socket_gbps``).

    cd / && /work/main/.venv/bin/python /work/main/bench/kv_reload.py --tokens 6800 --repeat 3
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time

import torch

from kv_tiers import SUFFIX, start_node, tokens, ttft, wait_written
from kv_reload_http import run_http
from kv_transfer import socket_gbps

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.llm import LLM
from kvmesh.engine.model.loader import load_model
from kvmesh.engine.transfer.ucx_env import apply_ucx_defaults


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=6800)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--path", choices=("lane", "ucx"), default="lane")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--http", action="store_true",
                    help="the path a user sees: two `kvmesh serve --cache-node` processes, the client's TTFT on "
                         "the second (bench/kv_reload_http.py)")
    ap.add_argument("--fresh-b", action="store_true", help="with --http: a new engine B for every repeat")
    ap.add_argument("--before", metavar="DIR", help="with --http: also run engine B from this checkout")
    args = ap.parse_args()
    # Before the node starts (it inherits them) and before this process's first ucxx call.
    os.environ.update(KVMESH_KV_SHM="1" if args.path == "lane" else "0", UCX_WARN_UNUSED_ENV_VARS="n")
    apply_ucx_defaults()
    loaded = load_model("default", getattr(torch, args.dtype))
    n = args.tokens // 16 * 16
    proc, port = start_node(str(256 * n * 1024))  # room for several fp32 prefixes
    try:
        if args.http:
            cfg = loaded.config
            nbytes = n * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim \
                * torch.finfo(getattr(torch, args.dtype)).bits // 8
            sock = statistics.median(socket_gbps(nbytes, max(3, args.repeat)))
            print(f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores, {n} tokens = "
                  f"{nbytes / 1e6:.1f} MB of {args.dtype} KV, path {args.path}, socket {sock:.2f} GB/s", flush=True)
            run_http(args, port, n, nbytes, loaded.config.vocab_size, sock, tokens)
            return 0
        llm = LLM(engine=LLMEngine(EngineConfig(model="default", dtype=args.dtype, device="cpu",
                                                num_kv_blocks=n // 16 + 64, cache_node=f"127.0.0.1:{port}",
                                                cache_node_timeout=60.0), loaded=loaded))
        kv = llm.engine.runner.kv_cache  # [layers, 2, blocks, block_size, heads, dim]
        nbytes = n * kv[:, :, 0, 0].numel() * kv.element_size()
        run(llm, args, n, nbytes, loaded.config.vocab_size)
        llm.engine.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(15)
    return 0


def run(llm: LLM, args: argparse.Namespace, n: int, nbytes: int, vocab: int) -> None:
    print(f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}, "
          f"{n} tokens = {nbytes / 1e6:.1f} MB of {args.dtype} KV, path {args.path}", flush=True)
    sock = statistics.median(socket_gbps(nbytes, max(3, args.repeat)))
    deadline = time.monotonic() + 30
    while llm.engine._cache_node.clients() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    written, local, reload, fetch = 0, [], [], []
    for r in range(args.repeat):
        prefix = tokens(n, 4242 + r, vocab)
        ask = prefix + tokens(SUFFIX, 7 + r, vocab)
        llm.engine.kv.reset_prefix_cache()
        ttft(llm, prefix + [5])  # computes the prefix and writes it through
        written += n // 16
        wait_written(llm, written)
        t, cached = ttft(llm, ask)
        assert cached >= n - 16, f"local hit covered only {cached} of {n} tokens"
        local.append(t)
        llm.engine.kv.reset_prefix_cache()
        t, cached = ttft(llm, ask)
        assert cached >= n - 16, f"cache node reload covered only {cached} of {n} tokens"
        reload.append(t)
        fb, fs = llm.engine.tiers.remote.last_fetch
        assert fb == nbytes, (fb, nbytes)
        fetch.append(fs)
        print(f"  run {r}: TTFT local hit {local[-1] * 1e3:.0f} ms, reloaded {reload[-1] * 1e3:.0f} ms "
              f"(fetch {fs * 1e3:.0f} ms)", flush=True)
    med = statistics.median
    move = med(r - lo for r, lo in zip(reload, local))
    rate = nbytes / move / 1e9 if move > 0 else float("inf")
    frate = nbytes / med(fetch) / 1e9
    print(f"socket {sock:.2f} GB/s | TTFT local hit {med(local) * 1e3:.0f} ms, reloaded {med(reload) * 1e3:.0f} ms | "
          f"move {move * 1e3:.0f} ms = {rate:.2f} GB/s = {rate / sock:.2f}x the socket | "
          f"fetch alone {med(fetch) * 1e3:.0f} ms = {frate:.2f} GB/s = {frate / sock:.2f}x | "
          f"end to end {nbytes / med(reload) / 1e9:.2f} GB/s")
    # The first reload of a process is reported apart: it is what a fresh engine's first user gets.
    first = reload[0] - local[0]
    print(f"first reload: move {first * 1e3:.0f} ms = {nbytes / first / 1e9 / sock:.2f}x the socket, "
          f"fetch {fetch[0] * 1e3:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
