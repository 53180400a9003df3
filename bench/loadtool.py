"""Cross-check of bench/serving.py with GuideLLM, a load generator we did not write.

GuideLLM runs from its own virtual environment (its dependencies differ from
ours); `run_guidellm` drives its CLI with the same workload shape as
bench/serving.py (synthetic chat prompts of a fixed token count, a fixed
number of output tokens with ignore_eos, Poisson arrivals at one rate, a fixed
request count) and reduces its JSON report to the same figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path


def tokenizer_dir(tokenizer) -> str:
    """A directory with the HF tokenizer files, for tools that load a tokenizer by path."""
    out = Path(tempfile.mkdtemp(prefix="kvmesh-tok-"))
    tokenizer.hf.save_pretrained(str(out))
    return str(out)


def guidellm_command(exe: str, url: str, model: str, tok_dir: str, rate: float, n: int, prompt_tokens: int,
                     max_tokens: int, seed: int, out: Path) -> list[str]:
    return [exe, "run",
            "--backend", f"kind=openai_http,target={url},model={model},request_format=/v1/chat/completions",
            "--profile", f"kind=poisson,rate={rate}",
            "--constraint", f"kind=max_requests,count={n}",
            "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={max_tokens}",
            "--tokenizer", f"kind=huggingface_auto,model={tok_dir}",
            "--seed", f"kind=static,value={seed}",
            "--output", f"kind=json,path={out}",
            "--disable-console-interactive"]


def run_guidellm(exe: str, url: str, model: str, tok_dir: str, rate: float, n: int, prompt_tokens: int,
                 max_tokens: int, seed: int, workers: int = 2) -> dict:
    """Run GuideLLM once; returns its command line and `summarize_guidellm` of its report."""
    out_dir = Path(tempfile.mkdtemp(prefix="kvmesh-guidellm-"))
    out = out_dir / "guidellm.json"
    cmd = guidellm_command(exe, url, model, tok_dir, rate, n, prompt_tokens, max_tokens, seed, out)
    # Offline, and no more client processes than this machine has cores to spare.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "GUIDELLM__MAX_WORKER_PROCESSES": str(workers)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=7200)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"guidellm failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return {"command": " ".join(cmd), "env": {"GUIDELLM__MAX_WORKER_PROCESSES": str(workers)},
            "report": str(out), "summary": summarize_guidellm(json.loads(out.read_text()))}


def summarize_guidellm(report: dict) -> dict:
    """TTFT/TPOT percentiles (seconds) and throughput from a GuideLLM JSON report's first benchmark.

    GuideLLM's "inter token latency" is (last - first token time) / (tokens - 1),
    which bench/serving.py calls TPOT; its own "time per output token" divides
    the whole latency, TTFT included, by all tokens. Throughputs are recomputed
    as totals over the benchmark's duration, as bench/serving.py computes them.
    """
    bench = report["benchmarks"][0]
    m = bench["metrics"]

    def dist(name: str, scale: float) -> dict[str, float]:
        d = m[name]["successful"]
        pct = d["percentiles"]
        return {"p50": pct["p50"] * scale, "p90": pct["p90"] * scale, "p99": pct["p99"] * scale,
                "mean": d["mean"] * scale}

    completed = m["request_totals"]["successful"]
    out_tokens = m["output_token_count"]["successful"]
    duration = bench["duration"]
    return {
        "ttft_s": dist("time_to_first_token_ms", 1e-3),
        "tpot_s": dist("inter_token_latency_ms", 1e-3),
        "latency_per_token_s": dist("time_per_output_token_ms", 1e-3),
        "e2e_s": dist("request_latency", 1.0),
        "prompt_tokens_mean": m["prompt_token_count"]["successful"]["mean"],
        "completed": completed,
        "duration_s": duration,
        "request_throughput": completed / duration,
        "output_tok_s": out_tokens["mean"] * out_tokens["count"] / duration,
    }


def crosscheck_table(rate: float, ours, theirs: dict) -> str:
    """Markdown table: our RateResult beside GuideLLM's summary at the same rate."""

    def row(name: str, ttft: dict, tpot: dict, tok_s: float, req_s: float, prompt: float) -> str:
        return (f"| {name} | {ttft['p50']:.2f} / {ttft['p90']:.2f} / {ttft['p99']:.2f} | "
                f"{tpot['p50'] * 1e3:.0f} / {tpot['p90'] * 1e3:.0f} / {tpot['p99'] * 1e3:.0f} | {tok_s:.1f} | "
                f"{req_s:.2f} | {prompt:.0f} |")

    return "\n".join([
        f"cross-check at {rate:g} req/s",
        "| tool | TTFT p50/p90/p99 (s) | TPOT p50/p90/p99 (ms) | out tok/s | req/s achieved | prompt tokens |",
        "|---|---|---|---|---|---|",
        row("bench/serving.py", ours.ttft_s, ours.tpot_s, ours.output_tok_s, ours.request_throughput,
            ours.prompt_tokens_mean),
        row("guidellm", theirs["ttft_s"], theirs["tpot_s"], theirs["output_tok_s"], theirs["request_throughput"],
            theirs["prompt_tokens_mean"]),
    ])
