"""The whole disaggregated data plane as real processes: router, one prefill and two decode engines (slow).

Real: `kvmesh serve --role prefill` and two `--role decode` engines on the default model (one torch
thread each), their UCX links, `kvmesh router --prefill-engines ... --engines ...` with the real
tokenizer, index and policies, and the official `openai` client. Nothing is faked. The reference
for the tokens is a decode engine serving the same request colocated.
"""

from __future__ import annotations

import signal
import time

import httpx
import openai
import pytest

from tests.support.processes import RouterProcess
from kvmesh.engine.util.localproc import free_port_pair
from tests.support.processes import ServerProcess

from tests.support.waits import nothing_held, wait_metric

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # a router and real prefill and decode servers: about 90 s

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Name a famous painter."]


@pytest.fixture(scope="module")
def plane():
    prefill = ServerProcess("--role", "prefill", "--num-threads", "1", "--num-kv-blocks", "256",
                            "--kv-events-port", str(free_port_pair()), "--kv-transfer-timeout", "5")
    decodes = [ServerProcess("--role", "decode", "--num-threads", "1", "--num-kv-blocks", "128",
                             "--kv-events-port", str(free_port_pair())) for _ in range(2)]
    router = None
    try:
        for p in [prefill, *decodes]:
            p.start()
        router = RouterProcess("--prefill-engines", prefill.base_url,
                               "--engines", ",".join(d.base_url for d in decodes),
                               "--health-interval-s", "0.5", "--pd-queue-timeout", "10").start()
        yield prefill, decodes, router
    finally:
        for p in ([router] if router else []) + decodes + [prefill]:
            if p.proc is not None and p.proc.poll() is None:
                p.signal(signal.SIGCONT)
            p.stop()


def _client(router: RouterProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url("/v1"), api_key="none", max_retries=0, timeout=120)


def _ask(client: openai.OpenAI, q: str, stream: bool = False) -> str:
    kw = dict(model="default", messages=[{"role": "user", "content": q}], max_tokens=16, temperature=0,
              extra_body={"ignore_eos": True})
    if not stream:
        return client.chat.completions.create(**kw).choices[0].message.content
    return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                   if c.choices)


def _colocated(decode: ServerProcess, q: str) -> str:
    body = {"messages": [{"role": "user", "content": q}], "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    return httpx.post(decode.url("/v1/chat/completions"), json=body, timeout=120).json()["choices"][0][
        "message"]["content"]


def test_requests_through_the_router_run_in_two_stages(plane):
    prefill, decodes, router = plane
    client = _client(router)
    for i, q in enumerate(QUESTIONS):
        assert _ask(client, q, stream=bool(i % 2)) == _colocated(decodes[0], q)
    handoffs = prefill.metric("kvmesh_kv_handoffs_total", outcome="ok")
    assert handoffs == len(QUESTIONS)
    # Prefill engines compute prompts and hand them off; decode engines generate from what they received.
    assert sum(d.metric("kvmesh_generation_tokens_total") or 0 for d in decodes) >= 16 * len(QUESTIONS)
    nothing_held(prefill, decodes[0])
    nothing_held(prefill, decodes[1])


def _sum_count(procs, name, **labels) -> tuple[float, float]:
    return (sum(p.metric(name + "_sum", **labels) or 0 for p in procs),
            sum(p.metric(name + "_count", **labels) or 0 for p in procs))


def test_the_routers_end_to_end_ttft_spans_both_stages(plane):
    """The router's TTFT histogram counts every streamed request from its receipt to the first
    token sent, so it exceeds what the decode engines time (from stage 2) and the prefill's own."""
    prefill, decodes, router = plane
    ttft, tpot = "kvmesh_router_time_to_first_token_seconds", "kvmesh_router_time_per_output_token_seconds"
    engine_ttft = "kvmesh_time_to_first_token_seconds"
    r0, n0 = _sum_count([router], ttft, stream="true")
    t0, tpot_n0 = _sum_count([router], tpot)
    d0, dn0 = _sum_count(decodes, engine_ttft)
    p0, pn0 = _sum_count([prefill], engine_ttft)
    client = _client(router)
    for q in QUESTIONS:
        assert _ask(client, q, stream=True)
    wait_metric(router, ttft + "_count", n0 + len(QUESTIONS), stream="true")
    wait_metric(router, tpot + "_count", tpot_n0 + len(QUESTIONS))
    for d in decodes:
        wait_metric(d, "kvmesh_num_requests_running", 0)
    r1, _ = _sum_count([router], ttft, stream="true")
    d1, dn1 = _sum_count(decodes, engine_ttft)
    p1, pn1 = _sum_count([prefill], engine_ttft)
    assert dn1 - dn0 == len(QUESTIONS)  # every request's stage 2 ran on a decode engine
    router_mean, decode_mean = (r1 - r0) / len(QUESTIONS), (d1 - d0) / len(QUESTIONS)
    assert router_mean > decode_mean, (router_mean, decode_mean)
    if pn1 - pn0 == len(QUESTIONS):  # the prefill engine's own TTFT misses the transfer and stage 2
        assert r1 - r0 > p1 - p0, (r1 - r0, p1 - p0)
    # 16 tokens each, one stream event per decode step: a positive time per token.
    assert _sum_count([router], tpot)[0] - t0 > 0


def test_a_stalled_decode_engine_is_routed_around(plane):
    """One decode engine stops answering: handoffs to it fail after the prefill side's transfer
    timeout, the router marks it failed and completes every request on the other one."""
    prefill, decodes, router = plane
    client = _client(router)
    decodes[0].signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        answers = [_ask(client, q) for q in QUESTIONS]
        elapsed = time.monotonic() - t0
    finally:
        decodes[0].signal(signal.SIGCONT)
    assert answers == [_colocated(decodes[1], q) for q in QUESTIONS]
    assert elapsed < 60
    nothing_held(prefill, decodes[1])
    wait_metric(decodes[0], "kvmesh_kv_transfers_reserved", 0, timeout=60)


def test_a_killed_decode_engine_is_routed_around_and_nothing_leaks(plane):
    prefill, decodes, router = plane
    client = _client(router)
    victim, survivor = decodes
    victim.signal(signal.SIGKILL)
    victim.proc.wait(10)
    answers = [_ask(client, q, stream=True) for q in QUESTIONS]
    assert answers == [_colocated(survivor, q) for q in QUESTIONS]
    nothing_held(prefill, survivor)
