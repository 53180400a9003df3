"""The router's own record of where it sent each prompt (engine/router/routed.py): the prefix
signal for engines that publish no KV events, on the proxy's and the picker's path alike.

Real: ``RoutedPrefixes``, ``Fleet``'s matching, ``Dispatcher.choose`` with the cache-aware policy,
and the ext_proc ``PickerStream`` driven with Envoy's own protobuf messages. Fake: the engines
(states marked healthy by hand; nothing is contacted) and the byte tokenizer. Against a real Envoy
and real engines: tests/router/test_extproc_real_engines.py.
"""

from __future__ import annotations

import asyncio

from kvmesh.engine.block_hash import hash_blocks
from kvmesh.engine.kv.events import TIER_GPU
from kvmesh.engine.router import epp
from kvmesh.engine.router.discovery import EngineState, engine_report_from_metrics
from kvmesh.engine.router.extproc_stream import PickerStream
from kvmesh.engine.router.routed import DEFAULT_CAPACITY, RoutedPrefixes
from tests.support.extproc_messages import ADDRS, POST, URLS, body_msg, chat_body, headers_msg, make_app
from tests.support.extproc_messages import response_headers as response_headers_msg
from tests.support.fake_http_engine import BLOCK_SIZE, EXTRA


def chain(tokens: list[int]) -> list:
    return hash_blocks(tokens, BLOCK_SIZE, EXTRA)


def test_a_recorded_prompt_matches_its_leading_run_only():
    r = RoutedPrefixes()
    prompt = chain(list(range(40)))  # 10 blocks
    r.record("a", prompt, capacity=100)
    assert r.match("a", prompt).blocks == 10
    assert r.match("a", prompt).per_tier == {TIER_GPU: 10}
    other = chain(list(range(16)) + [999] * 24)  # shares 4 blocks, then diverges
    assert r.match("a", other).blocks == 4
    assert r.match("b", prompt).blocks == 0  # another engine was sent nothing
    r.remove_engine("a")
    assert r.match("a", prompt).blocks == 0


def test_the_record_is_bounded_by_the_pool_and_evicts_tails_before_heads():
    r = RoutedPrefixes()
    first, second = chain(list(range(40))), chain(list(range(1000, 1040)))
    r.record("a", first, capacity=15)
    r.record("a", second, capacity=15)
    assert r.size() == {"a": {TIER_GPU: 15}}
    assert r.match("a", second).blocks == 10  # the newest prompt whole
    assert r.match("a", first).blocks == 5  # the older one lost its tail, its head still matches
    r.record("b", first, capacity=None)
    assert r.size()["b"][TIER_GPU] == min(10, DEFAULT_CAPACITY)


def test_the_pool_size_comes_from_the_engines_metrics():
    text = ('kvmesh_kv_cache_blocks{model_name="m",tier="gpu"} 512.0\n'
            'kvmesh_kv_cache_blocks{model_name="m",tier="cpu"} 9000.0\n'
            'kvmesh_kv_cache_free_blocks{model_name="m",tier="gpu"} 500.0\n')
    report = engine_report_from_metrics(text)
    assert (report.num_blocks, report.free_blocks) == (512, 500)
    st = EngineState("u")
    st.observe_report(report)
    assert st.num_blocks == 512


def pick_through_picker(app, text: str, response_mode: int) -> str:
    """One chat request through one ext_proc filter in BUFFERED mode that reads the response
    headers only (GIE's wiring): the address it was routed to."""
    async def run() -> str:
        s = PickerStream(app)
        s.response_mode = response_mode
        s._configured = True
        s.request_mode = epp.BODY_BUFFERED
        await s.handle(headers_msg(POST))
        [answer] = await s.handle(body_msg(chat_body(text)))
        address = answer.request_body.response.header_mutation.set_headers[0].header.raw_value.decode()
        s.response_headers(response_headers_msg(200, served=address))
        s.close(clean=False)  # Envoy 1.40 often resets the stream it is done with
        return address

    return asyncio.run(run())


def test_without_kv_events_a_repeated_prompt_goes_where_the_router_sent_it_before():
    """The issue's wiring at the message level: engines without KV events, one filter, BUFFERED
    request body, response headers only. Before the router kept its own record, the second pass
    was routed by load and rotation alone and prompts landed on the engine without their KV."""
    app = make_app(kv_events=False)
    prompts = [f"conversation {i}: " + "a long shared system prompt " * 20 for i in range(5)]
    first = {p: pick_through_picker(app, p, epp.BODY_NONE) for p in prompts}
    for p in reversed(prompts):  # another order than the first pass: no rotation can line up
        assert pick_through_picker(app, p, epp.BODY_NONE) == first[p], p
    fleet = app.fleet
    assert all(st.inflight == 0 for st in fleet.engines.values())  # every lease released
    assert sum(n[TIER_GPU] for n in fleet.routed.size().values()) > 0


def test_an_engine_that_publishes_events_is_matched_by_its_events_only():
    app = make_app(kv_events=False)
    fleet = app.fleet
    fleet.engines[URLS[0]].info["kv_events"] = {"port": 1}  # the index, not the record, says what it holds
    text = "a prompt the index has not heard of " * 10
    picked = {pick_through_picker(app, f"{i} {text}", epp.BODY_NONE) for i in range(4)}
    assert picked == set(ADDRS)  # nothing cached anywhere: ties rotate over both
    assert set(fleet.routed.size()) == {URLS[1]}
