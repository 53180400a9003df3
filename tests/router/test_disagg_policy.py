"""The two-stage flow's decisions as pure functions: the decode-pool policy, body preparation,
stage-1 classification (docs/disagg.md's table), backoff, the metrics scrape and the flags."""

import json

import pytest

from kvmesh.cli import build_parser
from kvmesh.engine.router import cli as router_cli
from kvmesh.engine.router.disagg import (
    BACKOFF_MAX_S,
    DECODE_FAILED,
    DECODE_REFUSED,
    NO_ROOM,
    OK,
    PREFILL_FAILED,
    RELAY,
    backoff_s,
    build_decode_policy,
    classify_stage1,
    error_code,
    needed_blocks,
    prepare_body,
    room_filter,
)
from kvmesh.engine.router.discovery import EngineState, engine_report_from_metrics
from kvmesh.engine.router.index import PrefixMatch
from kvmesh.engine.router.policies import Endpoint, LoadModel, RouteRequest
from kvmesh.engine.router.prompt import CHAT, COMPLETIONS


def hit(blocks: int) -> PrefixMatch:
    return PrefixMatch(blocks, {"gpu": blocks}, float(blocks))


def test_needed_blocks_counts_the_prompt_and_first_token_less_the_decode_side_hit():
    assert needed_blocks(15, 16, 0) == 1
    assert needed_blocks(16, 16, 0) == 2  # the first generated token opens a second block
    assert needed_blocks(100, 16, 3) == 4
    assert needed_blocks(100, 16, 99) == 1 and needed_blocks(0, 16, 0) == 1


def test_room_filter_prefers_engines_with_room_and_never_empties():
    req = RouteRequest(prompt_tokens=100, block_size=16, matches={"b": hit(5)})  # 7 blocks; b needs 2
    eps = [Endpoint("a", free_blocks=6), Endpoint("b", free_blocks=2), Endpoint("c", free_blocks=None),
           Endpoint("d", free_blocks=7)]
    assert [e.id for e in room_filter(req, eps)] == ["b", "c", "d"]
    full = [Endpoint("a", free_blocks=0), Endpoint("b", free_blocks=1)]
    assert [e.id for e in room_filter(req, full)] == ["a", "b"]  # stale reports: the engines decide


def test_decode_policy_weighs_decode_side_hits_against_load():
    policy = build_decode_policy("cache-aware", LoadModel(running_cost_tokens=64))
    eps = [Endpoint("a", running=1, free_blocks=100), Endpoint("b", running=0, free_blocks=100)]
    assert policy.choose(RouteRequest(200, 16), eps, 0) == "b"  # no hits: less load wins
    # b's one request in flight (64 tokens) weighs less than a's 8 cached blocks (128 tokens).
    eps = [Endpoint("a", running=1, free_blocks=100), Endpoint("b", running=0, free_blocks=100)]
    assert policy.choose(RouteRequest(200, 16, {"a": hit(8)}), eps, 0) == "a"
    # ...unless a has no room for the rest of the prompt.
    eps = [Endpoint("a", running=1, free_blocks=2), Endpoint("b", running=0, free_blocks=100)]
    assert policy.choose(RouteRequest(200, 16, {"a": hit(8)}), eps, 0) == "b"
    # Draining, unhealthy and excluded engines are never picked; ties rotate.
    eps = [Endpoint("a", draining=True), Endpoint("b", healthy=False), Endpoint("c"), Endpoint("d"),
           Endpoint("e")]
    assert policy.choose(RouteRequest(exclude=frozenset({"e"})), eps, 0) == "c"
    assert policy.choose(RouteRequest(exclude=frozenset({"e"})), eps, 1) == "d"
    assert policy.choose(RouteRequest(exclude=frozenset({"c", "d", "e"})), eps, 0) is None


def test_round_robin_stays_a_baseline_for_the_decode_pool():
    policy = build_decode_policy("round-robin")
    eps = [Endpoint("a", running=9, free_blocks=0), Endpoint("b", free_blocks=100)]
    assert [policy.choose(RouteRequest(200, 16), eps, t) for t in range(3)] == ["a", "b", "a"]


def test_prepare_body_strips_the_clients_transfer_params_and_adds_the_routers():
    body = json.dumps({"model": "m", "prompt": "hé", "temperature": 0.1, "max_tokens": 10**12,
                       "kv_transfer_params": {"transfer_id": "mine"}}).encode()
    p = prepare_body(COMPLETIONS, body)
    assert p.fallback is None
    out = json.loads(p.with_params({"transfer_id": "t1", "decode_host": "10.0.0.7", "decode_port": 8001}))
    assert out == {"model": "m", "prompt": "hé", "temperature": 0.1, "max_tokens": 10**12,
                   "kv_transfer_params": {"transfer_id": "t1", "decode_host": "10.0.0.7", "decode_port": 8001}}
    assert json.loads(p.with_params({"transfer_id": "t2"}))["kv_transfer_params"] == {"transfer_id": "t2"}
    assert json.loads(prepare_body(CHAT, b"{}").with_params({"transfer_id": "t"})) == {
        "kv_transfer_params": {"transfer_id": "t"}}


@pytest.mark.parametrize("path,body,reason", [
    (COMPLETIONS, {"prompt": "x", "n": 2}, "n_gt_1"),
    (COMPLETIONS, {"prompt": "x", "best_of": 3}, "n_gt_1"),
    (CHAT, {"messages": [], "n": 4}, "n_gt_1"),
    (COMPLETIONS, {"prompt": ["a", "b"]}, "multi_prompt"),
    (COMPLETIONS, {"prompt": [[1, 2], [3]]}, "multi_prompt"),
    (COMPLETIONS, {"prompt": "x", "echo": True, "logprobs": 1}, "prompt_logprobs"),
    (CHAT, {"messages": [], "prompt_logprobs": 0}, "prompt_logprobs"),
    (COMPLETIONS, b"{not json", "unparsed"),
    (COMPLETIONS, [1, 2], "unparsed"),
])
def test_prepare_body_sends_what_one_transfer_cannot_carry_plain(path, body, reason):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    assert prepare_body(path, raw).fallback == reason


@pytest.mark.parametrize("body", [{"prompt": [1, 2, 3]}, {"prompt": ["one"]}, {"prompt": "x", "n": 1},
                                  {"prompt": "x", "n": "2"}])  # a bad n is the engine's 400 to give
def test_prepare_body_keeps_single_prompts_two_stage(body):
    assert prepare_body(COMPLETIONS, json.dumps(body).encode()).fallback is None


def _err(code):
    return json.dumps({"error": {"message": "m", "type": "t", "param": None, "code": code}}).encode()


def test_classify_stage1_follows_the_contracts_table():
    ok = json.dumps({"object": "kv_transfer", "transfer_id": "T", "blocks_sent": 3}).encode()
    a = classify_stage1(200, ok, "T")
    assert a.kind == OK and a.transfer["blocks_sent"] == 3
    assert classify_stage1(200, ok, "other").kind == PREFILL_FAILED  # not this attempt's transfer
    assert "--role prefill" in classify_stage1(200, b'{"object": "text_completion"}', "T").detail
    assert classify_stage1(503, _err("decode_no_room"), "T").kind == NO_ROOM
    for code in ("decode_unreachable", "decode_failed"):
        assert classify_stage1(502, _err(code), "T").kind == DECODE_FAILED
    assert classify_stage1(502, _err("decode_refused"), "T").kind == DECODE_REFUSED
    for status, body in ((503, _err("draining")), (429, _err("too_many")), (500, b"oops"), (502, b"")):
        a = classify_stage1(status, body, "T")
        assert a.kind == PREFILL_FAILED and a.engine_down == (status == 503)
    for status in (400, 404, 422):
        a = classify_stage1(status, _err("invalid_request"), "T", ((b"x-request-id", b"r"),))
        assert a.kind == RELAY and a.body == _err("invalid_request") and a.headers == ((b"x-request-id", b"r"),)


def test_error_code_reads_openai_error_bodies_only():
    assert error_code(_err("transfer_not_found")) == "transfer_not_found"
    assert error_code(b"not json") is None and error_code(b'{"error": "x"}') is None


def test_backoff_doubles_to_a_cap():
    assert [backoff_s(i) for i in range(3)] == [0.05, 0.1, 0.2]
    assert backoff_s(10) == backoff_s(10**6) == BACKOFF_MAX_S


def test_metrics_scrape_reads_load_and_the_pools_free_blocks():
    text = ('kvmesh_num_requests_running{model_name="m"} 3.0\n'
            'kvmesh_num_requests_waiting{model_name="m"} 2.0\n'
            'kvmesh_num_requests_running_total 100\n'
            'kvmesh_kv_cache_free_blocks{model_name="m",tier="gpu"} 412.0\n'
            'kvmesh_kv_cache_free_blocks{model_name="m",tier="cpu"} 9.0\n')
    report = engine_report_from_metrics(text)
    assert (report.load, report.free_blocks) == (5, 412)
    assert engine_report_from_metrics("kvmesh_kv_cache_free_blocks 7\n").free_blocks == 7
    assert engine_report_from_metrics("").free_blocks is None
    st = EngineState("u", free_blocks=412, info={"block_size": 16, "role": "decode", "transfer_port": 8001})
    assert st.transfer_port == 8001 and st.endpoint().free_blocks == 412
    assert EngineState("u", info={"role": "prefill", "transfer_port": None}).transfer_port is None


def _settings(*argv):
    return router_cli.settings_from_args(build_parser().parse_args(["router", *argv]))


def test_prefill_flags_turn_two_stage_serving_on():
    s = _settings("--engines", "http://d:1", "--prefill-engines", "http://p:1,http://p:2",
                  "--pd-queue-timeout", "5", "--pd-max-queued", "10")
    assert s.disaggregated and s.prefill_engines == ("http://p:1", "http://p:2")
    assert (s.pd_queue_timeout_s, s.pd_max_queued) == (5.0, 10)
    s = _settings("--decode-service", "llm-decode.serving.svc:8000",
                  "--prefill-service", "llm-prefill.serving.svc:8000")
    assert s.disaggregated and [(x.host, x.port) for x in s.prefill_services] == [("llm-prefill.serving.svc", 8000)]
    assert not _settings("--engines", "http://d:1").disaggregated


@pytest.mark.parametrize("argv,match", [
    (("--engines", "http://a:1", "--prefill-engines", "http://a:1"), "both --engines and --prefill-engines"),
    (("--engines", "http://a:1", "--prefill-engines", "p:1"), "--prefill-engines: 'p:1' is not an http"),
    (("--engines", "http://a:1", "--prefill-service", "p"), "--prefill-service 'p': expected HOST:PORT"),
    (("--engines", "http://a:1", "--pd-queue-timeout", "-1"), "--pd-queue-timeout"),
    (("--prefill-engines", "http://p:1",), "no engines to route to"),
])
def test_bad_prefill_flags_are_refused_with_a_reason(argv, match):
    with pytest.raises(router_cli.RouterArgsError, match=match):
        _settings(*argv)
