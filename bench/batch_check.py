"""Server overhead at full batch: N chat requests at once, offline engine vs `kvmesh serve`.

Used by bench/serving.py --batch-check. The offline engine runs in this
process first and is dropped before the server is measured, so the two never
share the cores. Besides throughput it reports the CPU the client itself used
(it runs on the same machine) and the server's event-loop lag per engine step
(from `kvmesh_event_loop_lag_seconds`), which shows whether the loop keeps up.
"""

from __future__ import annotations

import asyncio
import time

import httpx

from kvmesh.engine.util.metrics import parse_samples, sample_value
from chat_client import send_chat


def offline_throughput(engine_flags: dict, prompts: list[str], max_tokens: int) -> dict:
    """Output tok/s of the offline engine on the same chat prompts, all submitted at once."""
    from kvmesh.engine.config import EngineConfig
    from kvmesh.engine.llm import LLM
    from kvmesh.engine.sampling import SamplingParams

    llm = LLM(EngineConfig(**engine_flags))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    convs = [[{"role": "user", "content": p}] for p in prompts]
    llm.chat(convs[:2], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    t0 = time.perf_counter()
    results = llm.chat(convs, params)
    dt = time.perf_counter() - t0
    return {"output_tok_s": sum(len(r.token_ids) for r in results) / dt, "seconds": dt}


def loop_lag_snapshot(url: str) -> dict[str, float]:
    """Cumulative count, sum and <=5 ms / <=25 ms bucket counts of the server's event-loop lag histogram."""
    s = parse_samples(httpx.get(url + "/metrics", timeout=30).text)
    name = "kvmesh_event_loop_lag_seconds"
    return {"count": sample_value(s, name + "_count") or 0.0, "sum": sample_value(s, name + "_sum") or 0.0,
            "le_5ms": sample_value(s, name + "_bucket", le="0.005") or 0.0,
            "le_25ms": sample_value(s, name + "_bucket", le="0.025") or 0.0}


def loop_lag_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    n = after["count"] - before["count"]
    if n <= 0:
        return {"steps": 0}
    return {"steps": n, "mean_ms": (after["sum"] - before["sum"]) / n * 1e3,
            "within_5ms": (after["le_5ms"] - before["le_5ms"]) / n,
            "within_25ms": (after["le_25ms"] - before["le_25ms"]) / n}


async def burst(url: str, model: str, prompts: list[str], max_tokens: int) -> dict:
    """All prompts at once as streaming requests: the server's throughput at full batch."""
    lag0 = loop_lag_snapshot(url)
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600, connect=30), limits=limits) as client:
        t0, cpu0 = time.perf_counter(), time.process_time()
        results = await asyncio.gather(*(send_chat(client, url, model, p, max_tokens) for p in prompts))
        cpu = time.process_time() - cpu0
    dt = max(r.done for r in results if r.ok) - t0
    ok = [r for r in results if r.ok]
    # The client shares the machine's cores with the server: report what it took.
    return {"output_tok_s": sum(r.output_tokens for r in ok) / dt, "seconds": dt, "completed": len(ok),
            "client_cpu_s": cpu, "event_loop_lag": loop_lag_delta(lag0, loop_lag_snapshot(url))}
