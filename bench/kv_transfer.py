"""KV block transfer throughput: a `kvmesh cache-node` process and this one, beside memcpy and a plain socket.

Moves ``--tokens`` tokens of KV in the default model's geometry (30 layers x K,V x 3 heads x 64
dims x bf16 = 23,040 bytes a token; 16-token blocks) as one batched put and one batched get, in
one invocation:

* ``memcpy``: one ``np.copyto`` of the same bytes between two touched buffers (one core);
* ``socket``: a plain loopback TCP socket between two processes (sendall / recv_into into a
  preallocated buffer);
* each kvmesh path, with its own node process (UCX reads its settings at start): ``lane`` (the
  same-host shared-memory lane, chosen automatically on one host) and ``ucx[TLS]`` (the network
  path alone, lanes off, for each ``--tls``).

The connection (with its lane, where there is one) is opened before the first timed round, as an
engine's pooled connection is. A put stores fresh hashes each round, so it moves every byte; the
node's budget holds two rounds, so its first three rounds (``put_fill``: two fill the budget, the
third arrives before the first evictions) land in memory the node touches for the first time, and
the later ones (``put``, ``--repeat`` of them) in the memory of evicted blocks, which the node
receives into again: the steady state of a full cache node. A put sends views of one buffer, as
an engine's gather hands them over; a get lands in a staging pool and hands the buffer back after
checking it, as an engine does after its scatter. ``*_cpu_s_per_gb``: CPU seconds (all threads)
per GB moved in the steady-state rounds, of this process and of the node.

    cd / && /work/main/.venv/bin/python /work/main/bench/kv_transfer.py --tls tcp

Reports the median of ``--repeat`` runs in GB/s (10^9 bytes per second) and % of memcpy.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from kvmesh.engine.block_hash import extra_key, hash_blocks
from kvmesh.engine.transfer.buffers import KVBlock
from kvmesh.engine.transfer.client import KVClient
from kvmesh.engine.transfer.header import BlockHeader, kv_layout
from kvmesh.engine.transfer.staging import StagingPool
from kvmesh.engine.transfer.ucx_env import apply_ucx_defaults
from kvmesh.engine.util.localproc import free_ports, wait_ready

BLOCK_SIZE = 16
FILL_ROUNDS = 3
"""Put rounds into memory the node touches for the first time: two fill its budget (two rounds'
bytes), and the third arrives before the first evictions give the node memory back."""


def _socket_sender(port: int, nbytes: int, repeat: int) -> None:
    data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    with socket.create_connection(("127.0.0.1", port)) as s:
        for _ in range(repeat):
            s.recv(1)  # go
            s.sendall(memoryview(data))


def socket_gbps(nbytes: int, repeat: int) -> list[float]:
    """Plain TCP over loopback between two processes, into a preallocated buffer."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    proc = mp.get_context("spawn").Process(target=_socket_sender, args=(srv.getsockname()[1], nbytes, repeat))
    proc.start()
    conn, _ = srv.accept()
    buf = np.empty(nbytes, np.uint8)
    buf[:] = 0  # touch the pages once, as a pool would be
    view = memoryview(buf)
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        conn.sendall(b"g")
        got = 0
        while got < nbytes:
            got += conn.recv_into(view[got:], nbytes - got)
        out.append(nbytes / (time.perf_counter() - t0) / 1e9)
    conn.close()
    srv.close()
    proc.join()
    return out


def memcpy_gbps(nbytes: int, repeat: int) -> list[float]:
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.zeros_like(src)
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        out.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return out


def make_blocks(tokens: int) -> list[KVBlock]:
    extra = extra_key("bench-model", "bfloat16")
    layout = kv_layout(extra, "bfloat16", BLOCK_SIZE, 30, 3, 64)
    hashes = hash_blocks(list(range(tokens)), BLOCK_SIZE, extra)
    # Views of one buffer, as an engine's gather from its KV cache hands them to a put.
    data = np.random.default_rng(1).integers(0, 255, layout.nbytes * len(hashes), dtype=np.uint8)
    out, parent = [], None
    for i, h in enumerate(hashes):
        out.append(KVBlock(BlockHeader(layout, h, parent), data[i * layout.nbytes:(i + 1) * layout.nbytes]))
        parent = h
    return out


def cpu_seconds(pid: int | None = None) -> float:
    """CPU time (user + system, all threads) of this process, or of ``pid``."""
    if pid is None:
        return time.process_time()
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def path_gbps(path: str, blocks: list[KVBlock], repeat: int) -> dict[str, list[float]]:
    """``path``: ``lane`` or ``ucx[TLS]``; this process is the engine's side (its defaults applied)."""
    tls = "tcp" if path == "lane" else path.removeprefix("ucx[").removesuffix("]")
    http_port, ucx_port = free_ports(2)
    # This process's ucxx context is created by the first client below, so these still apply.
    os.environ.update(UCX_TLS=tls, UCX_WARN_UNUSED_ENV_VARS="n", KVMESH_KV_SHM="1" if path == "lane" else "0")
    apply_ucx_defaults()
    kvmesh = str(Path(sys.executable).with_name("kvmesh"))
    nbytes = sum(b.nbytes for b in blocks)
    node = subprocess.Popen([kvmesh, "cache-node", "--memory", str(2 * nbytes), "--max-put", str(2 * nbytes),
                             "--host", "127.0.0.1", "--port", str(http_port), "--ucx-port", str(ucx_port),
                             "--log-level", "warning"], env=dict(os.environ))
    try:
        wait_ready(f"http://127.0.0.1:{http_port}/ready", 60, node, what="cache node")
        layout = blocks[0].header.layout
        hashes = [b.block_hash for b in blocks]
        res: dict[str, list[float]] = {"put_fill": [], "put": [], "get": []}
        # CPU seconds per GB moved, this process (the engine's side) and the node, steady state.
        cpu: dict[str, list[float]] = {"put_cpu": [], "put_node_cpu": [], "get_cpu": [], "get_node_cpu": []}

        def timed(what: str, fn):  # noqa: ANN001, ANN202
            c0, n0, t0 = cpu_seconds(), cpu_seconds(node.pid), time.perf_counter()
            out = fn()
            dt = time.perf_counter() - t0
            res[what].append(nbytes / dt / 1e9)
            if what != "put_fill":
                cpu[f"{what}_cpu"].append((cpu_seconds() - c0) / (nbytes / 1e9))
                cpu[f"{what}_node_cpu"].append((cpu_seconds(node.pid) - n0) / (nbytes / 1e9))
            return out

        # As an engine fetches: into a staging pool, each batch handed back once it has been used.
        staging = StagingPool()
        with KVClient("127.0.0.1", ucx_port, timeout=120, staging=staging) as c:
            c.stats().result(60)  # connected (and the lane set up) before anything is timed
            for i in range(FILL_ROUNDS + repeat):
                # Fresh hashes per round, so every put really moves its bytes.
                round_blocks = [KVBlock(BlockHeader(layout, bytes([i]) + b.block_hash[1:], None), b.data)
                                for b in blocks]
                statuses = timed("put_fill" if i < FILL_ROUNDS else "put", lambda: c.put(round_blocks).result(300))
                assert statuses.count("stored") == len(blocks), statuses[:3]
                got = timed("get", lambda: c.get(layout, [b.block_hash for b in round_blocks]).result(300))
                assert len(got) == len(hashes) and np.array_equal(got[-1].data, blocks[-1].data)
                staging.give(got[0].data)
                del got
        return res | cpu
    finally:
        node.terminate()
        node.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--tls", action="append", default=None, help="UCX_TLS value(s) for the network path (default: tcp)")
    ap.add_argument("--no-lane", action="store_true", help="skip the same-host lane")
    ap.add_argument("--one-path", default=None, help=argparse.SUPPRESS)  # child mode: one path, JSON out
    args = ap.parse_args()
    blocks = make_blocks(args.tokens)
    if args.one_path:
        print(json.dumps(path_gbps(args.one_path, blocks, args.repeat)))
        return
    nbytes = sum(b.nbytes for b in blocks)
    med = statistics.median
    memcpy = med(memcpy_gbps(nbytes, args.repeat))
    report: dict[str, object] = {"tokens": args.tokens, "blocks": len(blocks), "bytes": nbytes,
                                 "memcpy_gbps": round(memcpy, 3)}
    sock = med(socket_gbps(nbytes, args.repeat))
    report["socket"] = {"gbps": round(sock, 3), "pct_memcpy": round(100 * sock / memcpy, 1)}
    paths = ([] if args.no_lane else ["lane"]) + [f"ucx[{t}]" for t in args.tls or ["tcp"]]
    for path in paths:
        # A child process per path: ucxx reads UCX_* once, when its context is created.
        out = subprocess.run([sys.executable, __file__, "--tokens", str(args.tokens), "--repeat", str(args.repeat),
                              "--one-path", path], capture_output=True, text=True, check=True)
        res = json.loads(out.stdout.strip().splitlines()[-1])
        report[path] = {f"{k}_{what}": round(v, 3 if what == "gbps" else 1) for k, runs in res.items()
                        if not k.endswith("cpu")
                        for what, v in (("gbps", med(runs)), ("pct_memcpy", 100 * med(runs) / memcpy))}
        report[path] |= {f"{k}_s_per_gb": round(med(runs), 3) for k, runs in res.items() if k.endswith("cpu")}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
