"""Drive a prefill -> decode handoff between two in-process engines, step by step (no network)."""

from __future__ import annotations

import time
from concurrent.futures import Future

from kvmesh.engine.block_hash import chain_root
from kvmesh.engine.disagg.prefill_side import DECODE
from kvmesh.engine.sampling import SamplingParams
from kvmesh.engine.roles import DecodeClaim, PrefillHandoff


def _run_until(engine, pred, limit: int = 500):
    """Step (or idle-tick) ``engine`` until ``pred(outputs so far)``; waits while it waits on a cache node."""
    outs = []
    for _ in range(limit):
        outs += engine.step() if engine.has_unfinished_requests() else engine.idle_tick()
        if pred(outs):
            return outs
        if engine.waiting_on_transfers:
            time.sleep(0.01)
    raise AssertionError("engine did not get there")


def prefill(p, rid: str, prompt: list[int], params: SamplingParams, start: int, cache_salt: str | None = None):
    p.add_request(rid, prompt, params, handoff=PrefillHandoff(start), cache_salt=cache_salt)
    outs = _run_until(p, lambda o: any(x.request_id == rid and x.finished for x in o))
    out = [x for x in outs if x.request_id == rid][-1]
    assert out.finish_reason == "transfer", out
    return out.handoff


def decode(d, tid: str, rid: str, prompt: list[int], params: SamplingParams, handoff,
           cache_salt: str | None = None):
    d.decode.check_push(tid, handoff.start, handoff.hashes, True)
    d.idle_tick()
    fut = d.decode.fill(tid, handoff.start, handoff.data, True, handoff.first, handoff.state)
    d.idle_tick()
    fut.result(0)
    claimed: Future = Future()
    d.add_request(rid, prompt, params, handoff=DecodeClaim(tid, claimed), cache_salt=cache_salt)
    outs = _run_until(d, lambda o: any(x.request_id == rid and x.finished for x in o))
    assert claimed.done() and claimed.exception() is None
    return [t for x in outs if x.request_id == rid for t in x.new_token_ids]


def handoff_once(p, d, i: int, prompt, params, tid=None, cache_salt: str | None = None):
    tid = tid or f"t{i}"
    fut = d.decode.reserve(tid, prompt, params.max_tokens, root=chain_root(cache_salt))
    d.idle_tick()
    res = fut.result(0)
    h = prefill(p, f"p{i}", prompt, params, res.hit_blocks, cache_salt)
    toks = decode(d, tid, f"d{i}", prompt, params, h, cache_salt)
    p.prefill.release(f"p{i}", DECODE)
    p.idle_tick()
    return res, h, toks
