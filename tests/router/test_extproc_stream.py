"""The ext_proc picker's message handling, message by message, and fuzzed.

Real: ``PickerStream`` over a real ``RouterApp`` (its dispatcher, policy, prefix index, sessions and
metrics), Envoy's own ext_proc protobuf messages (xds-protos), the ``Lease`` accounting.
Fake: the tokenizer (tests/support/fake_step_engine.py's byte tokenizer) and the engines: the pool is
two engine states marked healthy by hand (nothing is contacted; the picker only decides).
Envoy itself is in test_extproc_envoy.py.
"""

from __future__ import annotations

import asyncio
import json

import hypothesis.strategies as st
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings

from kvmesh.engine.api.params import STATE_HINTS_HEADER, parse_state_hints
from kvmesh.engine.block_hash import hash_blocks
from kvmesh.engine.kv.events import KVSnapshot
from kvmesh.engine.router import epp
from kvmesh.engine.router.app import RouterApp
from kvmesh.engine.router.extproc_stream import PickerStream
from kvmesh.engine.router.prompt import CHAT, analyze
from tests.support.extproc_messages import (ADDRS, LIMIT, POST, URLS, body_msg, chat_body, destination, headers_msg,
                                            load, make_app, message, response_body, response_headers, run)
from tests.support.fake_http_engine import BLOCK_SIZE, EXTRA
from tests.support.fake_step_engine import FakeTokenizer


def test_buffered_mode_answers_headers_empty_then_routes_on_the_whole_body():
    app = make_app()
    s = PickerStream(app)
    out = run(s, headers_msg(POST, mode=epp.BODY_BUFFERED))
    assert [o.WhichOneof("response") for o in out] == ["request_headers"] and not out[0].request_headers.HasField("response")
    out = run(s, body_msg(chat_body("hello")))
    assert [o.WhichOneof("response") for o in out] == ["request_body"]
    assert destination(out[0]) in ADDRS
    assert sum(i for i, _ in load(app).values()) == 1  # the lease is held until the response ends


def test_full_duplex_holds_headers_until_the_body_ends_then_echoes_the_body():
    app = make_app()
    s = PickerStream(app)
    body = chat_body("hello " * 50)
    assert run(s, headers_msg(POST, mode=epp.BODY_FULL_DUPLEX)) == []
    assert run(s, body_msg(body[:10], eos=False)) == []
    out = run(s, body_msg(body[10:], eos=True))
    assert [o.WhichOneof("response") for o in out] == ["request_headers", "request_body"]
    assert destination(out[0]) in ADDRS
    echoed = out[1].request_body.response.body_mutation.streamed_response
    assert echoed.body == body and echoed.end_of_stream


def test_full_duplex_with_request_trailers_picks_at_the_trailers():
    s = PickerStream(make_app())
    out = run(s, headers_msg(POST, mode=epp.BODY_FULL_DUPLEX), body_msg(chat_body("x"), eos=False),
              pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
    assert [o.WhichOneof("response") for o in out] == ["request_headers", "request_body", "request_trailers"]
    assert not out[1].request_body.response.body_mutation.streamed_response.end_of_stream


def test_the_pick_is_the_proxy_pick_a_cached_prefix_wins_and_accounting_follows_the_response():
    app = make_app()
    body = chat_body("a long shared system prompt " * 8)
    ids = analyze(CHAT, body, FakeTokenizer()).token_ids
    hashes = hash_blocks(ids, BLOCK_SIZE, EXTRA)
    app.fleet.index.reset(URLS[1], KVSnapshot(1, "b", {"gpu": frozenset(hashes[:20])}))
    s = PickerStream(app)
    out = run(s, headers_msg(POST, mode=epp.BODY_BUFFERED), body_msg(body))
    assert destination(out[-1]) == ADDRS[1]
    assert s.session.predicted == 20 * BLOCK_SIZE
    queued = len(ids) - s.session.predicted
    assert load(app)[URLS[1]] == (1, queued)
    run(s, response_headers(served=ADDRS[1]))
    assert load(app)[URLS[1]] == (1, queued)  # a chat stream's headers come before any token
    run(s, response_body(b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n\n', False))
    assert load(app)[URLS[1]] == (1, queued)  # the role-only event carries no token
    run(s, response_body(b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n', False))
    assert load(app)[URLS[1]] == (1, 0)  # prefilled
    run(s, response_body(b"data: [DONE]\n\n", True))
    assert load(app) == {URLS[0]: (0, 0), URLS[1]: (0, 0)}
    assert app.metrics.requests.labels("cache-aware", URLS[1], "ok")._value.get() == 1


def _set_header(resp: pb.ProcessingResponse, key: str) -> str | None:
    common = getattr(resp, resp.WhichOneof("response")).response
    values = [h.header.raw_value.decode() for h in common.header_mutation.set_headers if h.header.key == key]
    return values[0] if values else None


def test_the_pick_tells_a_hybrid_engine_where_to_checkpoint_and_a_clients_own_hints_never_pass():
    """Engine 1 (hybrid) holds 20 blocks of the prompt's KV and no checkpoint: the pick sets the
    state-hints header at 20 blocks, as the HTTP router does; a client's own header is overwritten
    (with nothing, for a pool without hybrid engines)."""
    body = chat_body("a long shared system prompt " * 8)
    forged = {**POST, STATE_HINTS_HEADER: "16,32"}
    plain = make_app()
    out = run(PickerStream(plain), headers_msg(forged, mode=epp.BODY_BUFFERED), body_msg(body))
    assert _set_header(out[-1], STATE_HINTS_HEADER) == ""
    app = make_app()
    for st_ in app.fleet.engines.values():
        st_.info["hybrid"] = True
    hashes = hash_blocks(analyze(CHAT, body, FakeTokenizer()).token_ids, BLOCK_SIZE, EXTRA)
    app.fleet.index.reset(URLS[1], KVSnapshot(1, "b", {"gpu": frozenset(hashes[:20])}))
    out = run(PickerStream(app), headers_msg(forged, mode=epp.BODY_BUFFERED), body_msg(body))
    assert parse_state_hints(_set_header(out[-1], STATE_HINTS_HEADER)) == (20 * BLOCK_SIZE,)


def test_a_dead_stream_releases_the_engine_and_counts_an_abort():
    app = make_app()
    s = PickerStream(app)
    run(s, headers_msg(POST, mode=epp.BODY_BUFFERED), body_msg(chat_body("hi")))
    assert sum(i for i, _ in load(app).values()) == 1
    s.close()
    s.close()  # idempotent
    assert load(app) == {URLS[0]: (0, 0), URLS[1]: (0, 0)}
    assert app.metrics.requests.labels("cache-aware", s.session.url, "aborted")._value.get() == 1


def test_the_served_endpoint_header_moves_the_load_to_the_engine_that_answered():
    app = make_app()
    s = PickerStream(app)
    run(s, headers_msg(POST, mode=epp.BODY_BUFFERED), body_msg(chat_body("hi")))
    other = next(a for a in ADDRS if a != s.session.address)
    run(s, response_headers(served=other))
    other_url = URLS[ADDRS.index(other)]
    assert load(app)[other_url][0] == 1 and sum(i for i, _ in load(app).values()) == 1
    run(s, response_body(b"{}", True))
    assert all(v == (0, 0) for v in load(app).values())


def test_the_subset_hint_restricts_the_candidates_and_an_empty_one_is_a_503():
    for _ in range(4):
        out = run(PickerStream(make_app()), headers_msg(POST, mode=epp.BODY_BUFFERED, subset=[ADDRS[0]]),
                  body_msg(chat_body("hi")))
        assert destination(out[-1]) == ADDRS[0]
    out = run(PickerStream(make_app()), headers_msg(POST, mode=epp.BODY_BUFFERED, subset=["10.9.9.9:1"]),
              body_msg(chat_body("hi")))
    imm = out[-1].immediate_response
    assert imm.status.code == 503 and b"10.9.9.9:1" in imm.body


def test_no_ready_engine_is_503_and_every_engine_at_the_shed_limit_is_429():
    app = make_app()
    for st_ in app.fleet.engines.values():
        st_.healthy = False
    out = run(PickerStream(app), headers_msg(POST, mode=epp.BODY_BUFFERED), body_msg(chat_body("hi")))
    assert out[-1].immediate_response.status.code == 503
    app = make_app(shed=1)
    first = PickerStream(app)
    run(first, headers_msg(POST, mode=epp.BODY_BUFFERED), body_msg(chat_body("one")))
    second = PickerStream(app)
    run(second, headers_msg(POST, mode=epp.BODY_BUFFERED), body_msg(chat_body("two")))
    out = run(PickerStream(app), headers_msg(POST, mode=epp.BODY_BUFFERED), body_msg(chat_body("three")))
    imm = out[-1].immediate_response
    assert imm.status.code == 429 and json.loads(imm.body)["error"]["code"] == "engines_saturated"
    assert any(h.header.key == "retry-after" for h in imm.headers.set_headers)


def test_bad_bodies_and_modes_get_a_clear_immediate_answer():
    cases = [(b"{not json", 400, "not valid JSON"), (b"[1, 2]", 400, "JSON object"),
             (chat_body("hi", model=None), 400, "'model'"), (b"x" * (LIMIT + 1), 413, "--max-request-bytes")]
    for body, status, words in cases:
        out = run(PickerStream(make_app()), headers_msg(POST, mode=epp.BODY_FULL_DUPLEX), body_msg(body))
        imm = out[-1].immediate_response
        assert imm.status.code == status and words in json.loads(imm.body)["error"]["message"], (body[:20], imm)
    big = dict(POST, **{"content-length": str(LIMIT + 1)})
    out = run(PickerStream(make_app()), headers_msg(big, mode=epp.BODY_BUFFERED))
    assert out[0].immediate_response.status.code == 413  # refused at the headers, before any body
    out = run(PickerStream(make_app()), headers_msg(POST, mode=epp.BODY_STREAMED))
    imm = out[0].immediate_response
    assert imm.status.code == 500 and b"request_body_mode BUFFERED or FULL_DUPLEX_STREAMED" in imm.body


def test_a_request_without_body_is_routed_at_its_headers():
    out = run(PickerStream(make_app()), headers_msg({":method": "GET", ":path": "/v1/models"}, eos=True,
                                                    mode=epp.BODY_FULL_DUPLEX))
    assert [o.WhichOneof("response") for o in out] == ["request_headers"] and destination(out[0]) in ADDRS

# ---- fuzz ------------------------------------------------------------------------------
def _check_stream(app: RouterApp, msgs: list[pb.ProcessingRequest]) -> None:
    async def go() -> None:
        s = PickerStream(app)
        for m in msgs:
            for answer in await s.handle(m):
                assert isinstance(answer, pb.ProcessingResponse) and answer.WhichOneof("response")
                answer.SerializeToString()  # a message Envoy can receive
        s.close()

    asyncio.run(go())
    assert all(v == (0, 0) for v in load(app).values()), load(app)  # nothing leaks past the stream


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(message(), max_size=8))
def test_fuzz_message_sequences_never_raise_and_never_leak_load(msgs):
    """Any sequence of well-formed ext_proc messages, in any order, with any fields."""
    _check_stream(make_app(), msgs)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_random_protobuf_bytes(raw):
    """Random wire bytes that parse as a ProcessingRequest (unknown and garbled fields included)."""
    try:
        msg = pb.ProcessingRequest.FromString(raw)
    except DecodeError:
        return  # gRPC would have refused these bytes before the picker saw them
    _check_stream(make_app(), [headers_msg(POST, mode=epp.BODY_FULL_DUPLEX), msg, body_msg(chat_body("x")), msg])


def test_the_router_flags_give_the_picker_port_and_the_shed_limit_and_refuse_nonsense():
    import pytest

    from kvmesh.cli import build_parser
    from kvmesh.engine.router.cli import RouterArgsError, settings_from_args

    def parse(*flags: str):
        return settings_from_args(build_parser().parse_args(["router", "--engines", URLS[0], *flags]))

    s = parse("--ext-proc-port", "9002", "--shed-above-running", "8", "--host", "0.0.0.0")
    assert (s.ext_proc_port, s.ext_proc_host, s.load.shed_running) == (9002, "0.0.0.0", 8)
    assert parse().ext_proc_port is None and parse().load.shed_running == 0
    assert parse().ext_proc_front == "auto" and parse("--ext-proc-front", "python").ext_proc_front == "python"
    with pytest.raises(SystemExit):
        parse("--ext-proc-front", "rust")
    for flags, words in ((("--ext-proc-port", "70000"), "0-65535"), (("--ext-proc-port", "8000"), "a port each"),
                         (("--shed-above-running", "-1"), ">= 0")):
        with pytest.raises(RouterArgsError, match=words):
            parse(*flags)


def test_the_envoy_config_in_the_docs_is_the_renderers_and_envoy_accepts_every_variant(tmp_path):
    """docs/gateway.md shows gateway_config's output verbatim; `envoy --mode validate` (when the
    binary is here) accepts the config in each body mode, fail-open, the direct baseline and the
    round-robin balancer the fleet benchmark puts in front of other engines."""
    import re
    import subprocess
    from pathlib import Path

    import yaml

    from kvmesh.engine.router.envoy_config import BODY_MODES, direct_config, gateway_config, round_robin_config
    from kvmesh.engine.util.envoy_proc import find_envoy

    doc = (Path(__file__).parents[2] / "docs" / "gateway.md").read_text()
    block = re.search(r"<!-- envoy-config: .*? -->\n```yaml\n(.*?)```", doc, re.S)
    assert block is not None and yaml.safe_load(block.group(1)) == gateway_config("0.0.0.0:8080", "10.0.0.5:9002")
    envoy = find_envoy()
    if envoy is None:
        return
    configs = [gateway_config("127.0.0.1:1", "127.0.0.1:2", m, observer=o) for m in BODY_MODES for o in (True, False)]
    configs += [gateway_config("127.0.0.1:1", "127.0.0.1:2", "BUFFERED", failure_mode_allow=True,
                               fallback=["127.0.0.1:3"]), direct_config("127.0.0.1:1", "127.0.0.1:3"),
                round_robin_config("127.0.0.1:1", ["127.0.0.1:3", "127.0.0.1:4"])]
    rr = round_robin_config("127.0.0.1:1", ["127.0.0.1:3", "127.0.0.1:4"])["static_resources"]["clusters"][0]
    assert rr["lb_policy"] == "ROUND_ROBIN" and len(rr["load_assignment"]["endpoints"][0]["lb_endpoints"]) == 2
    for i, c in enumerate(configs):
        path = tmp_path / f"{i}.yaml"
        path.write_text(yaml.safe_dump(c))
        got = subprocess.run([envoy, "--mode", "validate", "-c", str(path)], capture_output=True, text=True, timeout=60)
        assert got.returncode == 0, got.stdout[-2000:] + got.stderr[-2000:]


def test_a_picker_port_in_use_is_a_clear_startup_error():
    """Real: the gRPC server binding a loopback port another socket holds."""
    import socket

    import pytest

    from kvmesh.engine.router.extproc import ExtProcServer

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]

        async def start() -> None:
            await ExtProcServer(make_app(), "127.0.0.1", port).start()

        with pytest.raises(OSError, match="port is in use"):
            asyncio.run(start())
