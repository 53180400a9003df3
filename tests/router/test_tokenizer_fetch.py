"""The tokenizer a router takes from an engine (GET /kv/tokenizer): both sides of the contract
with the real code (`Tokenizer.to_payload` on the engine, `Tokenizer.from_payload` in the router)
on the real default tokenizer, payloads from the network fuzzed, and a router that has no
tokenizer is not ready (fake engines, which have none to give, over real TCP)."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvmesh.engine.model.tokenizer import Tokenizer, TokenizerLoadError
from kvmesh.engine.router.app import RouterApp, RouterSettings
from kvmesh.engine.router.cli import load_tokenizer

from kvmesh.engine.util.asgi import ServerThread

from tests.support.fake_http_engine import FakeEngine


@pytest.fixture(scope="module")
def engine_tokenizer():
    return load_tokenizer("default")


@pytest.fixture(scope="module")
def payload(engine_tokenizer):
    # What the engine's /kv/tokenizer answers, through JSON as on the wire.
    return json.loads(json.dumps(engine_tokenizer.to_payload()))


def test_the_rebuilt_tokenizer_gives_the_engines_ids_for_chats_and_prompts(engine_tokenizer, payload):
    got = Tokenizer.from_payload(payload)
    assert got.fingerprint == engine_tokenizer.fingerprint and got.eos_token_ids == engine_tokenizer.eos_token_ids
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Ünïcode, emoji 🦔, tabs\tok?"}]
    assert got.apply_chat_template(chat) == engine_tokenizer.apply_chat_template(chat)
    text = "def f(x):\n    return x ** 2  # squares"
    assert got.encode(text) == engine_tokenizer.encode(text)


def test_a_payload_whose_files_do_not_match_its_fingerprint_is_refused(payload):
    files = dict(payload["files"])
    files["chat_template.jinja"] = "{{ messages[0]['content'] }}"  # another chat template
    with pytest.raises(TokenizerLoadError, match="fingerprint"):
        Tokenizer.from_payload({**payload, "files": files})


@pytest.mark.parametrize("files", [
    {"../tokenizer.json": "{}"}, {"sub/tokenizer.json": "{}"}, {".hidden.json": "{}"},
    {"tokenizer.model": "binary"}, {"tokenizer.json": 3}, {}])
def test_file_sets_with_paths_other_suffixes_or_no_tokenizer_are_refused(files):
    with pytest.raises(TokenizerLoadError):
        Tokenizer.from_payload({"fingerprint": "x", "files": files})


_names = st.sampled_from(["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                          "chat_template.jinja", "vocab.json", "merges.txt", "added_tokens.json"])
_json_text = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                          lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                          max_leaves=8).map(json.dumps)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(
    st.none(), st.integers(), st.text(max_size=10), st.lists(st.integers(), max_size=3),
    st.fixed_dictionaries({"fingerprint": st.text(max_size=8),
                           "eos_token_ids": st.one_of(st.lists(st.integers(), max_size=3), st.text(max_size=3),
                                                      st.lists(st.booleans(), max_size=2)),
                           "files": st.dictionaries(_names, st.one_of(_json_text, st.text(max_size=20)), max_size=4)})))
def test_any_malformed_payload_is_a_tokenizer_load_error_never_another_exception(body):
    with pytest.raises(TokenizerLoadError):
        Tokenizer.from_payload(body)


def test_a_prefix_policy_without_a_tokenizer_is_not_ready_and_says_why():
    engines = [FakeEngine("a"), FakeEngine("b")]
    servers = [ServerThread(e).start() for e in engines]
    app = RouterApp(RouterSettings(policy="cache-aware", engines=tuple(s.url for s in servers),
                                   health_interval_s=0.2, sync_timeout_s=5))
    router = ServerThread(app).start()
    try:
        r = httpx.get(router.url + "/ready", timeout=10)
        body = r.json()
        assert r.status_code == 503 and body["ready"] is False and body["tokenizer"] is None
        assert "HTTP 404" in body["tokenizer_problem"], body
        # Requests are still answered (by load), not refused.
        done = httpx.post(router.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        assert done.status_code == 200
        # A load policy needs no tokenizer: ready.
        plain = RouterApp(RouterSettings(policy="least-load", engines=tuple(s.url for s in servers),
                                         health_interval_s=0.2, sync_timeout_s=5))
        plain_router = ServerThread(plain).start()
        try:
            got = httpx.get(plain_router.url + "/ready", timeout=10)
            assert got.status_code == 200 and got.json()["tokenizer_problem"] is None
        finally:
            plain_router.stop()
    finally:
        router.stop()
        for s in servers:
            s.stop()
