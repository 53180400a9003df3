"""A process that talks KV over real ucxx to a peer that stalls and dies, over and over.

Run by ``test_stalled_peers.py`` as its own process, so that memory corruption shows up as this
process dying (a segfault exits with -11) instead of taking pytest down. It is the side that
must survive: the prefill engine pushing to a decode engine, an engine writing to a cache node.

The peer is a real ``kvmesh cache-node`` process (the same KV block protocol, framing and
handshake as a decode engine's endpoint). Each cycle: one request completes; the peer is stopped
(SIGSTOP) with a put of 4 MiB in flight; more requests time out, some on new connections whose
handshake the stopped peer cannot answer; the peer resumes (it then answers every handshake and
message it missed) or is killed and replaced. A thread encodes JSON all along, so a stray write
into freed memory meets live Python objects. Prints one JSON line of counts at the end.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from kvmesh.engine.transfer import posted
from kvmesh.engine.transfer.client import AsyncKVClient
from kvmesh.engine.transfer.errors import TransferError
from kvmesh.engine.transfer.loop_thread import shared_loop
from kvmesh.engine.transfer.ucx_env import apply_ucx_defaults

from kvmesh.engine.util.localproc import free_ports, wait_ready
from tests.support.kv_blocks import blocks, layout

KVMESH = str(Path(sys.executable).with_name("kvmesh"))


def start_node() -> tuple[subprocess.Popen, int]:
    http_port, ucx_port = free_ports(2)
    proc = subprocess.Popen([KVMESH, "cache-node", "--memory", "256MiB", "--host", "127.0.0.1",
                             "--port", str(http_port), "--ucx-port", str(ucx_port), "--log-level", "error"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n"))
    wait_ready(f"http://127.0.0.1:{http_port}/ready", 60, proc, what="cache node")
    return proc, ucx_port


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cycles", type=int, default=12)
    ap.add_argument("--kill-every", type=int, default=3, help="kill and replace the peer every N cycles")
    args = ap.parse_args()
    apply_ucx_defaults()  # as the server processes run it (Python futures on)
    lay = layout("float32", block_size=16, layers=8, heads=4, head_dim=64)  # 256 KiB blocks
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            json.dumps({"a": [list(range(40)) for _ in range(20)], "b": "x" * 64})

    threading.Thread(target=churn, daemon=True).start()
    loop = shared_loop()
    counts: dict[str, int] = {}

    def count(key: str) -> None:
        counts[key] = counts.get(key, 0) + 1

    node, port = start_node()
    client = AsyncKVClient("127.0.0.1", port, timeout=1.0, connect_timeout=2.0)
    for cycle in range(args.cycles):
        good, _ = blocks(lay, 2, seed=cycle)
        try:
            loop.call(client.put(good, timeout=20.0), 30)
            count("ok")
        except TransferError as e:
            count("ok_failed:" + type(e).__name__)
        node.send_signal(signal.SIGSTOP)
        for attempt in range(3):  # the first on the pooled connection, then fresh connects
            stalled, _ = blocks(lay, 16, seed=10_000 + cycle * 10 + attempt)
            try:
                loop.call(client.put(stalled, timeout=0.4), 10)
                count("stalled_ok")
            except TransferError as e:
                count(type(e).__name__)
            del stalled
            gc.collect()
        if (cycle + 1) % args.kill_every == 0:
            node.send_signal(signal.SIGKILL)
            node.wait(10)
            loop.call(client.aclose(), 10)
            node, port = start_node()
            client = AsyncKVClient("127.0.0.1", port, timeout=1.0, connect_timeout=2.0)
            count("killed")
        else:
            node.send_signal(signal.SIGCONT)
            count("resumed")
        gc.collect()
    # The last request after all that must work: nothing this side holds is broken.
    final, _ = blocks(lay, 2, seed=99_999)
    loop.call(client.put(final, timeout=20.0), 30)
    loop.call(client.aclose(), 10)
    node.send_signal(signal.SIGKILL)
    node.wait(10)
    left = loop.call(posted.drain(10.0), 15)
    stop.set()
    gc.collect()
    print(json.dumps({"counts": counts, "posted_left": left}), flush=True)


if __name__ == "__main__":
    main()
