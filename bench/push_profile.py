"""Where a prefill -> decode push's time goes, message by message.

Starts a real decode server (`kvmesh serve --role decode`, default model, one torch thread) and, in
this process, a prefill engine with the server's own ``DecodeLinks``; for ``--rounds`` fresh prompts
of ``--tokens`` tokens it reserves, prefills, then times the push (one part: the blocks and the
first token) and each control message and payload batch inside it, as the channel sees them
(timers wrapped around ``Channel.send``/``expect``/``send_payloads``; they add a little Python per
call). The first two rounds warm up (connections, the lane) and are not printed.

    cd / && /work/main/.venv/bin/python /work/main/bench/push_profile.py --tokens 107 --rounds 12
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time

import httpx

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.disagg.prefill_link import DecodeLinks
from kvmesh.engine.disagg.prefill_side import DECODE
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.kv.gather import cache_layout
from kvmesh.engine.roles import PrefillHandoff
from kvmesh.engine.sampling import SamplingParams
from kvmesh.engine.transfer import channel
from kvmesh.engine.util.localproc import free_port, wait_ready


def time_channel(marks: list[tuple[str, float]]) -> None:
    """Record (what, seconds) for every send, expect and payload batch on any channel."""
    def wrap(name: str, orig):  # noqa: ANN001, ANN202
        async def timed(self, *a, **k):  # noqa: ANN001, ANN202
            t0 = time.perf_counter()
            out = await orig(self, *a, **k)
            what = {"send": lambda: type(a[0]).__name__, "expect": lambda: a[0].__name__,
                    "send_payloads": lambda: f"{len(a[0])} payloads"}[name]()
            marks.append((f"{name} {what}", time.perf_counter() - t0))
            return out
        return timed

    for name in ("send", "expect", "send_payloads"):
        setattr(channel.Channel, name, wrap(name, getattr(channel.Channel, name)))


async def rounds(eng: LLMEngine, links: DecodeLinks, port: int, n: int, tokens: int,
                 marks: list[tuple[str, float]]) -> list[tuple[float, list[tuple[str, float]]]]:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    out = []
    for i in range(n):
        prompt = [(i * 7919 + j * 31) % 40000 + 100 for j in range(tokens)]
        res = await links.reserve("127.0.0.1", port, f"t{i}", prompt, 1)
        eng.add_request(f"p{i}", prompt, params, handoff=PrefillHandoff(res.hit_blocks))
        done = None
        while done is None:
            done = next((o for o in eng.step() if o.finished), None)
        marks.clear()
        t0 = time.perf_counter()
        await links.push("127.0.0.1", port, f"t{i}", done.handoff, True)
        out.append((time.perf_counter() - t0, list(marks)))
        eng.prefill.release(f"p{i}", DECODE)
        eng.idle_tick()
        await links.cancel("127.0.0.1", port, f"t{i}")  # frees the decode side's reservation
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=107)
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args()
    port = free_port()
    decode = subprocess.Popen([sys.executable, "-m", "kvmesh", "serve", "--role", "decode", "--port", str(port),
                               "--num-threads", "1", "--num-kv-blocks", "1024"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(f"http://127.0.0.1:{port}/ready", 300, decode, what="decode engine")
        transfer_port = httpx.get(f"http://127.0.0.1:{port}/kv/info", timeout=10).json()["transfer_port"]
        eng = LLMEngine(EngineConfig(num_threads=1, num_kv_blocks=1024))
        links = DecodeLinks(cache_layout(eng.kv.extra, eng.runner.kv_cache))
        marks: list[tuple[str, float]] = []
        time_channel(marks)
        rows = asyncio.run(rounds(eng, links, transfer_port, args.rounds, args.tokens, marks))[2:]
        for total, ms in rows:
            print(f"push {1e3 * total:6.2f} ms | " + " | ".join(f"{w} {1e3 * s:.2f}" for w, s in ms))
        print(f"median push {1e3 * statistics.median(t for t, _ in rows):.2f} ms over {len(rows)} rounds")
        per = {}
        for _, ms in rows:
            for w, s in ms:
                per.setdefault(w, []).append(s)
        for w, v in per.items():
            print(f"  {w:<24} median {1e3 * statistics.median(v):6.2f} ms")
    finally:
        decode.terminate()
        decode.wait(30)


if __name__ == "__main__":
    main()
