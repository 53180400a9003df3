"""The credential policy every kvmesh HTTP server applies (engine/api/auth.py), decided directly:
which access a path needs, what each credential grants, token files that rotate, and the ASGI
gate answering in OpenAI's error shape. Real: the policy and the gate; the app behind the gate is
a stand-in that records being reached."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from kvmesh.engine.api.auth import (
    CLIENT, INTERNAL, OPEN, AuthConfigError, AuthGate, Credentials, TokenFile, access_for, bearer, read_api_keys,
)


@pytest.mark.parametrize("path, access", [
    ("/health", OPEN), ("/ready", OPEN), ("/metrics", OPEN),
    ("/admin/drain", INTERNAL), ("/kv/info", INTERNAL), ("/kv/snapshot", INTERNAL), ("/kv/tokenizer", INTERNAL),
    ("/v1/chat/completions", CLIENT), ("/v1/models", CLIENT), ("/metrics/x", CLIENT), ("/kvx", CLIENT),
    ("/tokenize", CLIENT), ("/detokenize", CLIENT),
])
def test_each_path_needs_one_access(path, access):
    assert access_for(path) == access


def test_bearer_reads_only_bearer_credentials():
    assert bearer("Bearer abc") == "abc" and bearer(b"bearer  abc ") == "abc"
    assert bearer(None) is None and bearer("Basic abc") is None and bearer("Bearer ") is None


@pytest.fixture
def creds(tmp_path: Path) -> Credentials:
    (tmp_path / "token").write_text("internal-tok\n")
    return Credentials.from_options(str(tmp_path / "token"), ["key-a"], ())


@pytest.mark.parametrize("access, header, status", [
    (OPEN, None, None),
    (CLIENT, None, 401), (CLIENT, "Bearer key-a", None), (CLIENT, "Bearer internal-tok", None),
    (CLIENT, "Bearer wrong", 401),
    (INTERNAL, None, 401), (INTERNAL, "Bearer internal-tok", None), (INTERNAL, "Bearer wrong", 401),
    (INTERNAL, "Bearer key-a", 403),  # a client key never drains an engine
])
def test_what_each_credential_grants(creds, access, header, status):
    err = creds.check(access, header)
    assert (err.status if err else None) == status
    if err is not None:
        assert err.body()["error"]["code"] in ("invalid_api_key", "forbidden")
        assert "internal-tok" not in err.message and "key-a" not in err.message


def test_without_keys_the_openai_endpoints_are_open_and_without_a_token_so_is_the_rest(tmp_path):
    (tmp_path / "t").write_text("tok")
    token_only = Credentials.from_options(str(tmp_path / "t"))
    assert token_only.check(CLIENT, None) is None and token_only.check(INTERNAL, None).status == 401
    keys_only = Credentials(api_keys=frozenset({"k"}))
    assert keys_only.check(INTERNAL, None) is None and keys_only.check(CLIENT, None).status == 401
    assert not Credentials().enabled


def test_a_token_file_is_reread_when_it_changes_and_kept_while_it_is_empty(tmp_path):
    path = tmp_path / "token"
    path.write_text("one")
    tf = TokenFile(path)
    assert tf.token == "one"
    new = tmp_path / "token.new"
    new.write_text("two")
    os.replace(new, path)  # how a Secret volume rotates: a new file under the same name
    assert tf.token == "two"
    path.write_text("")
    assert tf.token == "two"


def test_unusable_files_fail_with_their_name(tmp_path):
    with pytest.raises(AuthConfigError, match="missing"):
        TokenFile(tmp_path / "missing")
    (tmp_path / "empty").write_text("  \n")
    with pytest.raises(AuthConfigError, match="empty"):
        TokenFile(tmp_path / "empty")
    (tmp_path / "keys").write_text("# a comment\nk1\n\n  k2  \n")
    assert read_api_keys(["k0", " "], [str(tmp_path / "keys")]) == {"k0", "k1", "k2"}
    with pytest.raises(AuthConfigError, match="nokeys"):
        read_api_keys((), [str(tmp_path / "nokeys")])


def _call(app, path: str, headers: list[tuple[bytes, bytes]]) -> tuple[int, dict, bool]:
    sent: list[dict] = []
    reached = []

    async def inner(scope, receive, send):
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def receive():
        raise AssertionError("the gate must not read the body of a refused request")

    async def send(msg):
        sent.append(msg)

    gate = AuthGate(inner, app, on_refused=lambda a, s: refused.append((a, s)))
    refused: list = []
    asyncio.run(gate({"type": "http", "path": path, "headers": headers}, receive, send))
    body = json.loads(sent[1]["body"]) if sent[0]["status"] != 200 else {}
    return sent[0]["status"], body, bool(reached)


def test_the_gate_refuses_before_the_app_and_lets_the_rest_through(creds):
    status, body, reached = _call(creds, "/admin/drain", [(b"authorization", b"Bearer key-a")])
    assert (status, reached) == (403, False) and body["error"]["type"] == "invalid_request_error"
    status, body, reached = _call(creds, "/v1/models", [])
    assert (status, reached) == (401, False) and body["error"]["code"] == "invalid_api_key"
    assert _call(creds, "/v1/models", [(b"Authorization", b"Bearer key-a")])[::2] == (200, True)
    assert _call(creds, "/metrics", [])[::2] == (200, True)


def test_isolated_tenants_are_salted_by_their_key_and_internal_callers_keep_theirs(tmp_path):
    token = tmp_path / "token"
    token.write_text("the-internal-token\n")
    creds = Credentials.from_options(str(token), ["key-a", "key-b"], isolate_tenants=True)
    a, b = (creds.cache_salt(f"Bearer {k}", None) for k in ("key-a", "key-b"))
    assert a.startswith("tenant:") and a != b and "key-a" not in a  # the key never enters a hash
    assert creds.cache_salt("Bearer key-a", None) == a  # stable: the tenant's cache survives restarts
    assert creds.cache_salt("Bearer key-a", "split") == f"{a}/split"
    assert creds.cache_salt("Bearer the-internal-token", "set-by-the-router") == "set-by-the-router"
    assert Credentials.from_options(None, ["key-a"]).cache_salt("Bearer key-a", "own") == "own"
    with pytest.raises(AuthConfigError, match="--isolate-tenants needs client keys"):
        Credentials.from_options(str(token), isolate_tenants=True)


def test_the_router_rewrites_only_the_salt_of_a_json_object_body():
    from kvmesh.engine.router.prompt import with_cache_salt

    body = b'{"model": "m", "prompt": "hi", "cache_salt": "mine"}'
    out = json.loads(with_cache_salt(body, lambda own: f"tenant:x/{own}"))
    assert out == {"model": "m", "prompt": "hi", "cache_salt": "tenant:x/mine"}
    assert json.loads(with_cache_salt(b'{"prompt": "hi"}', lambda own: "tenant:x"))["cache_salt"] == "tenant:x"
    for bad in (b"not json", b"[1, 2]", b""):
        assert with_cache_salt(bad, lambda own: "tenant:x") == bad  # the engine answers it with a 4xx
    assert with_cache_salt(body, lambda own: own) is body  # nothing to change: not re-encoded


def test_a_rotated_key_file_is_re_read(tmp_path):
    """A Kubernetes Secret's keys change under a running router: the new key works at once, the
    old one stops working; a file that vanishes mid-rotation keeps the last keys."""
    keys = tmp_path / "keys"
    keys.write_text("# tenants\nkey-one\n")
    creds = Credentials.from_options(None, (), [str(keys)])
    assert creds.check(CLIENT, "Bearer key-one") is None
    keys.write_text("key-two\nkey-three\n")
    assert creds.check(CLIENT, "Bearer key-one").status == 401
    assert creds.check(CLIENT, "Bearer key-three") is None
    keys.unlink()
    assert creds.check(CLIENT, "Bearer key-two") is None
    empty = tmp_path / "none"
    empty.write_text("# no keys yet\n")
    assert Credentials.from_options(None, (), [str(empty)]).check(CLIENT, None).status == 401  # closed, not open
