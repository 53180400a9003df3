"""Request analysis (tokenize + hash) and discovery's pure helpers."""

import json

import pytest

from kvmesh.engine.block_hash import hash_blocks
from kvmesh.engine.router.discovery import (
    DiscoveryError,
    EngineState,
    engine_load_from_metrics,
    membership_change,
    parse_engine_urls,
    parse_hostport,
    url_for,
)
from kvmesh.engine.router.prompt import CHAT, COMPLETIONS, analyze, common_hash_spec, matched_tokens
from kvmesh.engine.api import params
from kvmesh.engine.api.protocol import ChatCompletionRequest
from tests.support.fake_step_engine import FakeTokenizer

from tests.support.fake_http_engine import EXTRA

TOK = FakeTokenizer()


def test_analyze_tokenizes_as_the_engine_does():
    body = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], "user": "u"}
    info = analyze(CHAT, json.dumps(body).encode(), TOK)
    assert info.token_ids == params.chat_prompt_ids(TOK, ChatCompletionRequest.model_validate(body))
    assert info.user == "u" and info.num_prompt_tokens == len(info.token_ids)
    assert info.hashes(4, EXTRA) == hash_blocks(info.token_ids, 4, EXTRA)
    assert info.hashes(4, EXTRA) is info.hashes(4, EXTRA)  # memoized

    multi = analyze(COMPLETIONS, json.dumps({"prompt": ["abcd", "efghij"]}).encode(), TOK)
    assert multi.token_ids == TOK.encode("abcd") and multi.num_prompt_tokens == 10
    ids = analyze(COMPLETIONS, json.dumps({"prompt": [5, 6, 7]}).encode(), TOK)
    assert ids.token_ids == [5, 6, 7]


@pytest.mark.parametrize("body", [b"{not json", b'{"prompt": ""}', b'{"messages": []}', b"[1]",
                                  b'{"prompt": [0, 0, 0, -1]}', b'{"prompt": [4294967296]}',
                                  b'{"messages": [{"role": "tool", "content": "x"}], "user": "v"}'])
def test_analyze_never_rejects_what_it_cannot_read(body):
    info = analyze(CHAT if b"messages" in body else COMPLETIONS, body, TOK)
    assert info.token_ids is None and info.hashes(4, EXTRA) == []
    if b'"user"' in body:
        assert info.user == "v"


def test_analyze_without_tokenizer_reads_only_user():
    info = analyze(COMPLETIONS, b'{"prompt": "x", "user": "w"}', None)
    assert info.token_ids is None and info.user == "w"


def test_matched_tokens_leaves_the_last_prompt_token_to_compute():
    assert matched_tokens(3, 16, 100) == 48
    assert matched_tokens(4, 16, 64) == 63  # every block hit: the last token runs again
    assert matched_tokens(3, 16, 64) == 48
    assert matched_tokens(4, 16, 65) == 64
    assert matched_tokens(0, 16, 1) == 0


def test_common_hash_spec_takes_the_majority_and_skips_unknown():
    assert common_hash_spec([(16, b"x"), (16, b"x"), (32, b"y"), (None, None)]) == (16, b"x")
    assert common_hash_spec([(None, None)]) is None


def test_parse_sources():
    assert parse_hostport("llm-decode.serving.svc:8000", "--decode-service").host == "llm-decode.serving.svc"
    assert parse_hostport("[::1]:9", "--x").host == "::1"
    with pytest.raises(DiscoveryError, match="expected HOST:PORT"):
        parse_hostport("nohost", "--decode-service")
    assert parse_engine_urls("http://a:1/, http://b:2") == ["http://a:1", "http://b:2"]
    with pytest.raises(DiscoveryError, match="not an http"):
        parse_engine_urls("a:1")
    assert url_for("10.0.0.1", 80) == "http://10.0.0.1:80" and url_for("fe80::1", 80) == "http://[fe80::1]:80"


def test_membership_and_load_helpers():
    assert membership_change(["a", "b"], ["b", "c"]) == (["c"], ["a"])
    text = ("# HELP x\nkvmesh_num_requests_running{model=\"m\"} 3.0\n"
            "kvmesh_num_requests_waiting{model=\"m\"} 2.0\nother 9\n")
    assert engine_load_from_metrics(text) == 5
    assert engine_load_from_metrics("nothing 1\n") is None
    st = EngineState("u", healthy=True, inflight=2, reported_load=5, queued_prefill_tokens=7)
    ep = st.endpoint()
    assert (ep.running, ep.queued_prefill_tokens) == (5, 7)  # the engine saw more than this router sent
    assert not st.synced  # no /kv/info yet
