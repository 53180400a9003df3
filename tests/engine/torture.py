"""A seeded tier-and-handoff torture workload, checked token for token against transformers.

Two real engines on a tiny random Llama (fp32, block size 4) share a real `kvmesh cache-node`
process: a prefill engine with chunked prefill (8 tokens a step) and a decode engine, both with
primary pools of a few dozen blocks and a host tier of a few blocks, so that every block is
evicted, saved to the host tier, dropped from it, written through to the cache node and loaded
back over and over. Requests draw prompts from a few prefix families (so they share blocks) and
run as plain requests on either engine, or as prefill->decode handoffs (the decode engine
reserves, the prefill engine computes and pushes, the decode engine claims and decodes);
several run at once, so the decode engine preempts, in stretches of one at a time, so either
engine idles between steps (its transfer commands then run on idle ticks); some are aborted midway, and some handoffs
are given up on (the prefill aborted, the reservation cancelled). A decode engine without room
refuses the reservation and the request runs plain instead, as the router's fallback does.

Every finished request's tokens must equal transformers' unpaged greedy continuation of its
prompt; an aborted one's must be a prefix of it. The one tolerated difference is a near-tie:
at a position where the reference's two best logits are within ``TIE`` of each other, summation
order alone may pick either, and the comparison of that request stops there (counted).
"""

from __future__ import annotations

import dataclasses
import random
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvmesh.engine.block_hash import hash_blocks
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.disagg.errors import HandoffError
from kvmesh.engine.disagg.prefill_side import DECODE
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.sampling import SamplingParams
from kvmesh.engine.roles import DecodeClaim, PrefillHandoff

BS = 4
TIE = 1e-4


@dataclass(frozen=True)
class Workload:
    requests: int = 300
    seed: int = 0
    families: int = 6
    max_new: int = 6
    concurrency: int = 5
    p_handoff: float = 0.45
    p_plain_prefill: float = 0.15
    p_abort: float = 0.015  # per live request per round
    p_give_up: float = 0.05  # per handoff: abort it on the prefill side after its reservation


@dataclass
class Report:
    requests: int = 0
    handoffs: int = 0
    fallbacks: int = 0  # handoffs the decode engine had no room for, run plain
    aborted: int = 0
    given_up: int = 0
    preemptions: int = 0
    ties: int = 0
    mismatches: list[str] = field(default_factory=list)
    unique_blocks: int = 0
    host_saves: int = 0
    host_loads: int = 0
    node_saves: int = 0
    node_loads: int = 0
    seconds: float = 0.0

    @property
    def cycles_per_block(self) -> float:
        """Blocks brought back into a primary pool from a lower tier, per distinct block."""
        return (self.host_loads + self.node_loads) / max(1, self.unique_blocks)


class Reference:
    """transformers' greedy continuation (KV cache kept contiguous, not paged) with, at each
    position, the gap between the two best logits."""

    def __init__(self, model_dir: Path, max_new: int) -> None:
        from transformers import AutoModelForCausalLM

        self.hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.max_new = max_new
        self._memo: dict[tuple[int, ...], tuple[list[int], list[float]]] = {}

    def __call__(self, prompt: list[int]) -> tuple[list[int], list[float]]:
        key = tuple(prompt)
        if key not in self._memo:
            toks, gaps = [], []
            with torch.inference_mode():
                out = self.hf(torch.tensor([prompt]), use_cache=True)
                for _ in range(self.max_new):
                    top = out.logits[0, -1].topk(2)
                    tok = int(top.indices[0])
                    toks.append(tok)
                    gaps.append(float(top.values[0] - top.values[1]))
                    out = self.hf(torch.tensor([[tok]]), cache=out.cache, use_cache=True)
            self._memo[key] = (toks, gaps)
        return self._memo[key]


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    max_tokens: int
    kind: str  # plain-d | plain-p | handoff
    tokens: list[int] = field(default_factory=list)
    aborted: bool = False
    tid: str | None = None
    stage: str = "new"  # handoff: reserving -> prefilling -> checking -> filling -> decoding
    fut: Future | None = None
    handoff: object = None
    give_up: bool = False


def engines(model_dir: Path, loaded, node_http_port: int) -> tuple[LLMEngine, LLMEngine]:
    cfg = loaded.config
    block_bytes = BS * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4
    common = dict(model=str(model_dir), dtype="float32", device="cpu", block_size=BS,
                  cpu_kv_bytes=16 * block_bytes, cache_node=f"127.0.0.1:{node_http_port}", cache_node_timeout=10.0)

    def make(**kw) -> LLMEngine:
        return LLMEngine(EngineConfig(**common, **kw), loaded=dataclasses.replace(loaded, weights=dict(loaded.weights)),
                         debug_checks=True)

    p = make(num_kv_blocks=40, max_num_batched_tokens=8)
    d = make(num_kv_blocks=24, max_num_seqs=4)
    deadline = time.monotonic() + 30
    while any(e._cache_node.clients() is None for e in (p, d)):
        if time.monotonic() > deadline:
            raise AssertionError("the engines never resolved the cache node")
        time.sleep(0.05)
    return p, d


def _prompts(rng: random.Random, w: Workload, vocab: int) -> list[list[int]]:
    fams = [[rng.randrange(20, vocab - 20) for _ in range(rng.randrange(8, 25))] for _ in range(w.families)]
    tails = [[[rng.randrange(20, vocab - 20) for _ in range(rng.randrange(1, 11))] for _ in range(4)] for _ in fams]
    out = []
    for _ in range(w.requests):
        f = rng.randrange(len(fams))
        prompt = fams[f] + (rng.choice(tails[f]) if rng.random() < 0.8 else
                            [rng.randrange(20, vocab - 20) for _ in range(rng.randrange(1, 9))])
        out.append(prompt)
    return out


def run(p: LLMEngine, d: LLMEngine, ref: Reference, w: Workload) -> Report:
    rng = random.Random(w.seed)
    rep = Report()
    t0 = time.monotonic()
    prompts = _prompts(rng, w, p.model_config.vocab_size)
    rep.unique_blocks = len({h for pr in prompts for h in hash_blocks(pr, BS, d.kv.extra)})
    queue = []
    for i, pr in enumerate(prompts):
        x = rng.random()
        kind = "handoff" if x < w.p_handoff else "plain-p" if x < w.p_handoff + w.p_plain_prefill else "plain-d"
        queue.append(_Req(f"r{i}", pr, rng.randint(1, w.max_new), kind))
    queue.reverse()
    live: dict[str, _Req] = {}
    by_engine_rid: dict[str, _Req] = {}  # engine request id -> request

    def params(r: _Req) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)

    def start_plain(r: _Req, engine: LLMEngine, tag: str) -> None:
        r.stage = "plain"
        erid = f"{tag}-{r.rid}"
        by_engine_rid[erid] = r
        engine.add_request(erid, r.prompt, params(r))

    def finish(r: _Req) -> None:
        live.pop(r.rid, None)
        rep.requests += 1
        rep.aborted += r.aborted
        want, gaps = ref(r.prompt)
        got = r.tokens
        want = want[:r.max_tokens]
        if not r.aborted and len(got) != len(want):
            rep.mismatches.append(f"{r.rid} ({r.kind}): {len(got)} tokens, expected {len(want)}")
            return
        for i, tok in enumerate(got):
            if i >= len(want):
                rep.mismatches.append(f"{r.rid} ({r.kind}): more tokens than max_tokens")
                return
            if tok != want[i]:
                if gaps[i] < TIE:
                    rep.ties += 1
                else:
                    rep.mismatches.append(f"{r.rid} ({r.kind}): token {i} is {tok}, expected {want[i]} "
                                          f"(gap {gaps[i]:.2e}); prompt {r.prompt}")
                return

    def on_outputs(outs, engine: LLMEngine) -> None:
        for o in outs:
            r = by_engine_rid.get(o.request_id)
            if r is None:
                continue
            if r.kind == "handoff" and engine is p:
                if o.finished:
                    by_engine_rid.pop(o.request_id)
                    if o.finish_reason == "transfer":
                        r.handoff, r.stage = o.handoff, "checking"
                        h = o.handoff
                        r.fut = d.decode.check_push(r.tid, h.start, h.hashes, True)
                    else:  # given up on (aborted) before its prefill finished
                        d.decode.cancel(r.tid)
                        r.aborted = True
                        finish(r)
                continue
            r.tokens += o.new_token_ids
            if o.finished:
                by_engine_rid.pop(o.request_id)
                if o.finish_reason == "abort":
                    r.aborted = True
                finish(r)

    concurrency = w.concurrency
    while queue or live:
        while queue and len(live) < concurrency:
            if len(queue) % 25 == 0:
                # Stretches of one request at a time leave the other engine idle: its commands
                # (reservations, fills) then run on idle ticks, with no step (and no flush) between.
                concurrency = rng.choice([1, 1, 2, w.concurrency])
            r = queue.pop()
            live[r.rid] = r
            if r.kind == "handoff":
                r.tid, r.stage = f"t-{r.rid}", "reserving"
                r.give_up = rng.random() < w.p_give_up
                r.fut = d.decode.reserve(r.tid, r.prompt, r.max_tokens)
            else:
                start_plain(r, p if r.kind == "plain-p" else d, r.kind)
        for r in list(live.values()):
            if r.stage in ("plain", "decoding") and rng.random() < w.p_abort:
                engine = p if r.kind == "plain-p" else d
                engine.abort_request(next(k for k, v in by_engine_rid.items() if v is r))
        for engine in (p, d):
            outs = engine.step() if engine.has_unfinished_requests() else engine.idle_tick()
            on_outputs(outs, engine)
        for r in list(live.values()):
            if r.fut is None or not r.fut.done():
                continue
            fut, r.fut = r.fut, None
            err = fut.exception()
            if r.stage == "reserving":
                if isinstance(err, HandoffError):  # no room: run it plain, as the router falls back
                    rep.fallbacks += 1
                    r.kind = "plain-d"
                    start_plain(r, d, "fallback")
                    continue
                assert err is None, err
                rep.handoffs += 1
                r.stage = "prefilling"
                erid = f"p-{r.rid}"
                by_engine_rid[erid] = r
                p.add_request(erid, r.prompt, params(r), handoff=PrefillHandoff(fut.result().hit_blocks))
                if r.give_up:
                    rep.given_up += 1
                    p.abort_request(erid)
            elif r.stage == "checking":
                assert err is None, err
                h = r.handoff
                r.stage, r.fut = "filling", d.decode.fill(r.tid, h.start, h.data, True, h.first)
            elif r.stage == "filling":
                assert err is None, err
                p.prefill.release(f"p-{r.rid}", DECODE)
                r.stage = "decoding"
                erid = f"d-{r.rid}"
                by_engine_rid[erid] = r
                d.add_request(erid, r.prompt, params(r), handoff=DecodeClaim(r.tid, Future()))
        if not any(e.has_unfinished_requests() for e in (p, d)) and (p.waiting_on_transfers or
                                                                     d.waiting_on_transfers):
            time.sleep(0.002)  # a cache-node fetch is in flight
    for e in (p, d):
        deadline = time.monotonic() + 20  # write-throughs to the cache node may still hold blocks
        while (e.kv.requests or len(e.prefill) or len(e.decode)) and time.monotonic() < deadline:
            e.idle_tick()
            time.sleep(0.01)
        e.check_integrity()
        assert not e.kv.requests, e.kv.requests
        assert len(e.decode) == 0 and len(e.prefill) == 0
    for e in (p, d):
        st = e.stats()
        rep.preemptions += getattr(st, "num_preemptions", 0)
        for t in st.tiers:
            if t.tier == "cpu":
                rep.host_saves += t.stats.stored
                rep.host_loads += t.stats.promotions
            else:
                rep.node_saves += t.stats.stored
                rep.node_loads += t.stats.promotions
    rep.seconds = time.monotonic() - t0
    return rep
