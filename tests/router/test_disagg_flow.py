"""The router's two-stage (prefill/decode) flow against fake prefill and decode engines.

These tests prove only the router's state machine, not the engines: the fakes
(tests/support/fake_pd_engines.py) follow the HTTP contract of docs/disagg.md and script its answers,
and the tests check what the router does with each: stage 1 then stage 2 with the contract's
``kv_transfer_params``; another decode engine after ``decode_no_room``; waiting while every
decode engine refuses, then a clean 503 ``no_decode_capacity`` past the queue timeout or bound;
taking out a decode engine the prefill side reports failed; another prefill engine after a
prefill failure; starting over after 409 ``transfer_not_found`` or a decode engine lost before
its first byte; plain requests for ``n > 1`` or without a prefill pool; each streaming and not.
No KV is computed or moved. Real prefill and decode engines are covered elsewhere.

Real: the router's ASGI app under uvicorn on loopback, its aiohttp upstream connections,
discovery probes, the policies and the metrics. The tokenizer is tests/support/fake_step_engine.py's.
"""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest

from kvmesh.engine.router.app import RouterApp, RouterSettings
from kvmesh.engine.util.metrics import parse_samples, sample_value
from tests.support.fake_step_engine import FakeTokenizer

from kvmesh.engine.util.asgi import ServerThread

from tests.support.fake_http_engine import Behavior
from tests.support.fake_pd_engines import FakeDecode, FakePrefill, error


class PDCluster:
    def __init__(self, prefill: list[FakePrefill], decode: list[FakeDecode], policy: str = "cache-aware",
                 **settings) -> None:
        self.prefill, self.decode = prefill, decode
        self.servers = [ServerThread(e).start() for e in prefill + decode]
        for e, s in zip(prefill + decode, self.servers):
            e.url = s.url
        st = RouterSettings(policy=policy, engines=tuple(e.url for e in decode),
                            prefill_engines=tuple(e.url for e in prefill), health_interval_s=0.2,
                            sync_timeout_s=10, **settings)
        self.app = RouterApp(st, FakeTokenizer())
        self.router = ServerThread(self.app).start()
        self.url = self.router.url

    def stop(self) -> None:
        self.router.stop()
        for s in self.servers:
            s.stop()

    def metric(self, name, **labels):
        return sample_value(parse_samples(httpx.get(self.url + "/metrics").text), name, **labels) or 0


@pytest.fixture
def pd():
    made = []

    def make(*args, **kwargs):
        c = PDCluster(*args, **kwargs)
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()


def completion(url, prompt="hello world", stream=False, **extra):
    return httpx.post(url + "/v1/completions", json={"model": "fake-model", "prompt": prompt, "stream": stream,
                                                     **extra}, timeout=30)


def answered_by(r, stream):
    """The engine named in a response (every fake chunk names its engine); asserts it is clean."""
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["engine"]
    events = [line[6:] for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and all("error" not in e for e in events)
    assert [json.loads(e)["choices"][0]["text"] for e in events[:3]] == ["t0", "t1", "t2"]
    return json.loads(events[0])["engine"]


@pytest.mark.parametrize("stream", [False, True])
def test_two_stages_with_the_contracts_transfer_params(pd, stream):
    p0, d0 = FakePrefill("p0"), FakeDecode("d0")
    c = pd([p0], [d0])
    assert httpx.get(c.url + "/ready").status_code == 200
    # A client's own kv_transfer_params never reach an engine: the router owns the field.
    r = completion(c.url, stream=stream, kv_transfer_params={"transfer_id": "chosen-by-the-client"})
    assert answered_by(r, stream) == "d0"
    (stage1,) = p0.requests
    params = stage1.pop("kv_transfer_params")
    assert re.fullmatch(r"[0-9a-f]{32}", params["transfer_id"])
    assert params == {"transfer_id": params["transfer_id"], "decode_host": "127.0.0.1",
                      "decode_port": d0.transfer_port}
    assert stage1 == {"model": "fake-model", "prompt": "hello world", "stream": stream}
    (stage2,) = d0.requests
    assert stage2.pop("kv_transfer_params") == {"transfer_id": params["transfer_id"]}
    assert stage2 == stage1 and d0.served == [params["transfer_id"]]
    chat = httpx.post(c.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                            "stream": stream}, timeout=30)
    assert answered_by(chat, stream) == "d0"
    assert p0.requests[-1]["kv_transfer_params"]["transfer_id"] == d0.served[-1] != d0.served[0]
    assert c.metric("kvmesh_router_pd_stage1_total", outcome="ok") == 2
    assert c.metric("kvmesh_router_pd_stage1_seconds_count") == 2
    assert c.metric("kvmesh_router_pd_blocks_sent_total") == 4
    assert c.metric("kvmesh_router_pd_decode_hit_blocks_total") == 2
    assert c.metric("kvmesh_router_requests_total", policy="cache-aware", engine=d0.url, outcome="ok") == 2
    assert c.metric("kvmesh_router_upstream_ttft_seconds_count") == 2
    assert c.metric("kvmesh_router_prefill_engines_healthy") == 1
    assert c.metric("kvmesh_router_pd_fallback_total", reason="no_prefill") == 0


def test_end_to_end_ttft_spans_both_stages_and_tpot_the_decode_engines_stream(pd):
    p0 = FakePrefill("p0", stage1_delay_s=0.3)
    d0 = FakeDecode("d0", behavior=Behavior(chunks=3, chunk_interval_s=0.05))
    c = pd([p0], [d0])
    assert answered_by(completion(c.url, stream=True), True) == "d0"
    ttft = "kvmesh_router_time_to_first_token_seconds"
    deadline = time.monotonic() + 10
    while c.metric("kvmesh_router_time_per_output_token_seconds_count") < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert c.metric(ttft + "_count", stream="true") == 1
    # Stage 1 (0.3 s here) is what a decode engine's own TTFT never sees.
    assert 0.3 <= c.metric(ttft + "_sum", stream="true") < 5
    assert c.metric(ttft + "_bucket", stream="true", le="0.2") == 0
    tpot = c.metric("kvmesh_router_time_per_output_token_seconds_sum")
    assert 0.04 <= tpot <= 0.1  # 3 token events 0.05 s apart (no usage event: counted)


@pytest.mark.parametrize("stream", [False, True])
def test_decode_no_room_moves_the_request_to_another_decode_engine(pd, stream):
    full, free = FakeDecode("full", room=False), FakeDecode("free")
    c = pd([FakePrefill("p0")], [full, free])
    for i in range(4):  # prompts unlike each other tie, ties rotate, so "full" is offered some of them
        assert answered_by(completion(c.url, f"{i} hello world", stream=stream), stream) == "free"
    assert c.metric("kvmesh_router_pd_decode_refusals_total", engine=full.url) >= 1
    assert full.requests == []


def test_a_request_waits_while_every_decode_engine_refuses_then_is_served(pd):
    d0 = FakeDecode("d0", room=False)
    c = pd([FakePrefill("p0")], [d0], pd_queue_timeout_s=20)
    threading.Timer(0.6, lambda: setattr(d0, "room", True)).start()
    t0 = time.monotonic()
    assert answered_by(completion(c.url), False) == "d0"
    assert time.monotonic() - t0 >= 0.5
    assert c.metric("kvmesh_router_pd_decode_refusals_total", engine=d0.url) >= 2
    assert c.metric("kvmesh_router_pd_queue_wait_seconds_count") == 1
    assert c.metric("kvmesh_router_pd_queue_wait_seconds_sum") >= 0.5
    assert c.metric("kvmesh_router_pd_queued") == 0


def test_a_client_that_leaves_while_waiting_frees_its_place(pd):
    d0 = FakeDecode("d0", room=False)
    c = pd([FakePrefill("p0")], [d0], pd_queue_timeout_s=20)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(c.url + "/v1/completions", json={"prompt": "x"}, timeout=httpx.Timeout(30, read=0.5))
    deadline = time.monotonic() + 10
    while c.metric("kvmesh_router_pd_queue_wait_seconds_count") != 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert c.metric("kvmesh_router_pd_queued") == 0 and c.app.two_stage.queued == 0
    assert c.metric("kvmesh_router_pd_queue_rejected_total", reason="timeout") == 0


@pytest.mark.parametrize("stream", [False, True])
def test_past_the_queue_timeout_the_client_gets_a_clean_503(pd, stream):
    d0 = FakeDecode("d0", room=False)
    c = pd([FakePrefill("p0")], [d0], pd_queue_timeout_s=0.5)
    t0 = time.monotonic()
    r = completion(c.url, stream=stream)
    assert 0.5 <= time.monotonic() - t0 < 10
    assert r.status_code == 503 and r.headers["content-type"] == "application/json"
    assert r.headers["retry-after"] == "1"
    err = r.json()["error"]
    assert err["code"] == "no_decode_capacity" and "--pd-queue-timeout" in err["message"]
    assert c.metric("kvmesh_router_pd_queue_rejected_total", reason="timeout") == 1
    assert c.metric("kvmesh_router_pd_queued") == 0 and d0.requests == []


def test_past_the_queue_bound_the_client_gets_a_503_at_once(pd):
    c = pd([FakePrefill("p0")], [FakeDecode("d0", room=False)], pd_max_queued=0)
    r = completion(c.url)
    assert r.status_code == 503 and "--pd-max-queued" in r.json()["error"]["message"]
    assert c.metric("kvmesh_router_pd_queue_rejected_total", reason="full") == 1
    assert c.metric("kvmesh_router_pd_queue_wait_seconds_count") == 0


@pytest.mark.parametrize("failure", ["fail_transfer", "unreachable"])
def test_a_decode_engine_the_transfer_failed_on_is_taken_out(pd, failure):
    bad = FakeDecode("bad", fail_transfer=True) if failure == "fail_transfer" else FakeDecode("bad", reachable=False)
    good = FakeDecode("good")
    c = pd([FakePrefill("p0")], [bad, good])
    for i in range(4):  # prompts unlike each other tie, and ties rotate over both engines
        assert answered_by(completion(c.url, f"{i} hello world"), False) == "good"
        if c.metric("kvmesh_router_pd_stage1_total", outcome="decode_failed"):
            break
        for st in c.app.fleet.engines.values():  # a probe may not have brought it back yet
            st.healthy = True
    assert c.metric("kvmesh_router_pd_stage1_total", outcome="decode_failed") >= 1
    assert bad.requests == []


def test_a_decode_engine_that_refuses_a_transfer_is_avoided_for_that_request_only(pd):
    """A prefill engine's 502 decode_refused means the decode engine answered (it is up): the
    request moves to another decode engine, and the refusing one stays in the fleet."""
    picky, good = FakeDecode("picky", refuse_transfer=True), FakeDecode("good")
    c = pd([FakePrefill("p0")], [picky, good])
    for i in range(4):  # prompts unlike each other tie, and ties rotate over both engines
        assert answered_by(completion(c.url, f"{i} hello world"), False) == "good"
    assert c.metric("kvmesh_router_pd_stage1_total", outcome="decode_refused") >= 1
    assert c.metric("kvmesh_router_pd_stage1_total", outcome="decode_failed") == 0
    assert c.app.fleet.engines[picky.url].healthy


@pytest.mark.parametrize("failure", ["503", "429", "die_before_first"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_failed_prefill_engine_is_replaced_by_another(pd, failure, stream):
    behavior = (Behavior(mode="die_before_first") if failure == "die_before_first"
                else Behavior(mode="status", status=int(failure)))
    bad, good, d0 = FakePrefill("bad", behavior), FakePrefill("good"), FakeDecode("d0")
    c = pd([bad, good], [d0])
    for i in range(4):  # prompts unlike each other tie, and ties rotate over both prefill engines
        for st in c.app.prefill_fleet.engines.values():  # a 503 or a lost connection takes it out
            st.healthy = True
        assert answered_by(completion(c.url, f"{i} hello world", stream=stream), stream) == "d0"
        if bad.requests:
            break
    assert bad.requests and c.metric("kvmesh_router_pd_stage1_total", outcome="prefill_failed") >= 1
    assert len(d0.served) == len(good.requests)


def test_when_every_prefill_engine_is_busy_their_429_is_relayed(pd):
    busy = error("too_many_requests", "the engine's queue is full")
    p0, d0 = FakePrefill("p0", Behavior(mode="status", status=429, body=busy)), FakeDecode("d0")
    c = pd([p0], [d0])
    r = completion(c.url)
    assert r.status_code == 429 and r.json() == busy
    assert d0.requests == []


def test_when_every_prefill_engine_fails_a_decode_engine_serves_the_request_itself(pd):
    p0, d0 = FakePrefill("p0", Behavior(mode="status", status=500)), FakeDecode("d0")
    c = pd([p0], [d0])
    assert answered_by(completion(c.url), False) == "d0"
    assert "kv_transfer_params" not in d0.requests[-1]
    assert c.metric("kvmesh_router_pd_fallback_total", reason="prefill_failed") == 1


@pytest.mark.parametrize("failure", ["transfer_not_found", "die_before_first"])
@pytest.mark.parametrize("stream", [False, True])
def test_stage_two_lost_before_its_first_byte_starts_over_with_a_new_transfer(pd, failure, stream):
    if failure == "transfer_not_found":
        bad = FakeDecode("bad", forget_transfers=True)
    else:
        bad = FakeDecode("bad", Behavior(mode="die_before_first"))
    good, p0 = FakeDecode("good"), FakePrefill("p0")
    c = pd([p0], [bad, good])
    reason = "transfer_not_found" if failure == "transfer_not_found" else "disconnect"
    for i in range(4):  # prompts unlike each other tie, and ties rotate over both decode engines
        for st in c.app.fleet.engines.values():
            st.healthy = True
        assert answered_by(completion(c.url, f"{i} hello world", stream=stream), stream) == "good"
        if c.metric("kvmesh_router_pd_restarts_total", reason=reason):
            break
    assert c.metric("kvmesh_router_pd_restarts_total", reason=reason) >= 1
    ids = [r["kv_transfer_params"]["transfer_id"] for r in p0.requests]
    assert len(ids) == len(set(ids)) > len(good.served)  # a fresh transfer id per attempt
    assert bad.requests and good.served


def test_a_decode_engines_other_409_reaches_the_client(pd):
    d0 = FakeDecode("d0", Behavior(mode="status", status=409, body=error("conflict", "something else")))
    c = pd([FakePrefill("p0")], [d0])
    r = completion(c.url)
    assert r.status_code == 409 and r.json()["error"]["code"] == "conflict"


def test_a_prefill_engines_400_is_relayed_and_nothing_reaches_a_decode_engine(pd):
    body = error("context_length_exceeded", "prompt too long")
    c = pd([FakePrefill("p0", Behavior(mode="status", status=400, body=body))], [d0 := FakeDecode("d0")])
    r = completion(c.url)
    assert r.status_code == 400 and r.json() == body
    assert d0.requests == [] and c.metric("kvmesh_router_pd_stage1_total", outcome="relayed") == 1


@pytest.mark.parametrize("extra,reason", [({"n": 2}, "n_gt_1"), ({"prompt": ["one", "two"]}, "multi_prompt")])
@pytest.mark.parametrize("stream", [False, True])
def test_requests_one_transfer_cannot_carry_go_plain_to_a_decode_engine(pd, extra, reason, stream):
    p0, d0 = FakePrefill("p0"), FakeDecode("d0")
    c = pd([p0], [d0])
    assert answered_by(completion(c.url, stream=stream, **extra), stream) == "d0"
    assert p0.requests == [] and "kv_transfer_params" not in d0.requests[0]
    assert c.metric("kvmesh_router_pd_fallback_total", reason=reason) == 1


def test_without_a_healthy_prefill_engine_requests_go_plain_and_the_router_is_not_ready(pd):
    p0, d0 = FakePrefill("p0", Behavior(ready=False)), FakeDecode("d0")
    c = pd([p0], [d0])
    assert httpx.get(c.url + "/ready").status_code == 503  # both pools must be ready
    assert answered_by(completion(c.url, stream=True), True) == "d0"
    assert p0.requests == [] and "kv_transfer_params" not in d0.requests[0]
    assert c.metric("kvmesh_router_pd_fallback_total", reason="no_prefill") == 1
    assert c.metric("kvmesh_router_prefill_engines_healthy") == 0
    p0.behavior.ready = True
    deadline = time.monotonic() + 10
    while httpx.get(c.url + "/ready").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert answered_by(completion(c.url), False) == "d0" and len(p0.requests) == 1
