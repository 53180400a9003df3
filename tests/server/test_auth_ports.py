"""Every HTTP port of an authenticated fleet refuses an unauthenticated caller and serves an
authenticated one; the roles reach each other with the internal token.

Real: a `kvmesh cache-node`, a `kvmesh serve` (tiny random Llama, fp32) writing through to it, and a
`kvmesh router` in front, each started with `--auth-token-file` (and the engine and router with
`--api-key-file`). The router has no tokenizer of its own: it becomes ready only by fetching the
engine's `/kv/tokenizer` and `/kv/snapshot` with the token, and the engine resolves the cache node
through the node's `/kv/info` with it.
"""

from __future__ import annotations

import httpx
import pytest

from kvmesh.engine.util.localproc import free_port_pair

from tests.support.processes import NodeProc, RouterProcess, ServerProcess
from tests.support.tiny_models import make_tiny_hf_model
from tests.support.waits import wait_for

pytestmark = pytest.mark.slow  # three real processes: about 30 s

TOKEN, KEY, KEY2 = "internal-token-for-tests", "client-key-for-tests", "another-tenants-key"
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4,
        "temperature": 0}


def _auth(credential: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {credential}"} if credential else {}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    d = tmp_path_factory.mktemp("auth")
    (d / "token").write_text(TOKEN + "\n")
    (d / "keys").write_text(f"# client keys\n{KEY}\n{KEY2}\n")
    model = make_tiny_hf_model("llama", d / "model")
    auth = ("--auth-token-file", str(d / "token"))
    node = NodeProc(flags=auth).start()
    engine = router = None
    try:
        engine = ServerProcess("--model", str(model), "--served-model-name", "tiny", "--dtype", "float32",
                               "--block-size", "4", "--num-kv-blocks", "128", "--max-model-len", "256",
                               "--cache-node", f"127.0.0.1:{node.http_port}", "--kv-events-port",
                               str(free_port_pair()), *auth, "--api-key-file", str(d / "keys"),
                               "--isolate-tenants").start()
        router = RouterProcess("--engines", engine.base_url, "--policy", "cache-aware", "--model", "tiny",
                               "--health-interval-s", "0.5", *auth, "--api-key-file", str(d / "keys"),
                               "--isolate-tenants").start()
        yield node, engine, router
    finally:
        for p in (router, engine):
            if p is not None:
                p.stop()
        node.stop()


def test_the_engine_port(fleet):
    _, engine, _ = fleet
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(engine.url(path), timeout=10).status_code == 200, path
    for path in ("/kv/info", "/kv/snapshot", "/kv/tokenizer", "/admin/drain"):
        assert httpx.get(engine.url(path), timeout=10).status_code == 401, path
        assert httpx.get(engine.url(path), headers=_auth(KEY), timeout=10).status_code == 403, path
        assert httpx.get(engine.url(path), headers=_auth(TOKEN), timeout=10).status_code == 200, path
    refused = httpx.post(engine.url("/admin/drain"), headers=_auth(KEY), timeout=10)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "forbidden"
    assert httpx.get(engine.url("/ready"), timeout=10).status_code == 200  # nothing was drained
    r = httpx.post(engine.url("/v1/chat/completions"), json=BODY, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.post(engine.url("/v1/chat/completions"), json=BODY, headers=_auth(KEY), timeout=60).status_code == 200
    internals = dict(BODY, kv_transfer_params={"transfer_id": "t1", "decode_host": "127.0.0.1", "decode_port": 1})
    r = httpx.post(engine.url("/v1/chat/completions"), json=internals, headers=_auth(KEY), timeout=60)
    assert r.status_code == 403, r.text  # the prefill/decode internals are the router's alone
    assert engine.metric("kvmesh_auth_refused_total", access="internal", status="403") >= 5


def test_the_cache_node_port_and_the_engine_reaching_it(fleet):
    node, engine, _ = fleet
    assert node.http("/metrics")[0] == 200 and node.http("/ready")[0] == 200
    assert node.http("/kv/info")[0] == 401 and node.http("/kv/snapshot")[0] == 401
    r = httpx.get(f"http://127.0.0.1:{node.http_port}/kv/info", headers=_auth(TOKEN), timeout=10)
    assert r.status_code == 200 and r.json()["ucx_port"] == node.ucx_port
    # The engine found the node's UCX port through /kv/info with the token and wrote blocks through.
    long = dict(BODY, messages=[{"role": "user", "content": "write-through " * 6}])
    assert httpx.post(engine.url("/v1/chat/completions"), json=long, headers=_auth(KEY), timeout=60).status_code == 200

    def stored() -> float:
        from kvmesh.engine.util.metrics import parse_samples, sample_value

        text = httpx.get(f"http://127.0.0.1:{node.http_port}/metrics", timeout=10).text
        return sample_value(parse_samples(text), "kvmesh_cachenode_puts_total") or 0

    wait_for(lambda: stored() > 0, "blocks written through to the authenticated cache node", timeout=30)


def test_the_router_port_and_its_calls_to_the_engine(fleet):
    _, engine, router = fleet
    assert httpx.get(router.url("/ready"), timeout=10).json()["ready"]  # tokenizer and snapshot fetched
    before = engine.metric("kvmesh_auth_refused_total", access="client", status="401") or 0
    r = httpx.post(router.url("/v1/chat/completions"), json=BODY, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.post(router.url("/v1/chat/completions"), json=BODY, headers=_auth("nope"), timeout=60).status_code == 401
    direct = httpx.post(engine.url("/v1/chat/completions"), json=BODY, headers=_auth(KEY), timeout=60).json()
    routed = httpx.post(router.url("/v1/chat/completions"), json=BODY, headers=_auth(KEY), timeout=60)
    assert routed.status_code == 200
    assert routed.json()["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    # The engine's KV events (CURVE, keys from the token) reached the router's index after its snapshot.
    def indexed() -> float:
        from kvmesh.engine.util.metrics import parse_samples

        samples = parse_samples(httpx.get(router.url("/metrics"), timeout=10).text)
        return sum(v for (n, _), v in samples.items() if n == "kvmesh_router_index_blocks")

    wait_for(lambda: indexed() > 0, "KV events from the authenticated publisher in the router's index", timeout=30)
    # The router relayed with the internal token: the engine refused nothing of it.
    assert (engine.metric("kvmesh_auth_refused_total", access="client", status="401") or 0) == before
    assert router.metric("kvmesh_router_auth_refused_total", access="client", status="401") == 2


def test_isolated_tenants_share_no_prefix_through_the_router_or_directly(fleet):
    """--isolate-tenants on both: a key reuses only what the same key cached, whether it calls the
    router (which salts the body it relays) or the engine (which salts requests made with a key)."""
    _, engine, router = fleet
    for i, server in enumerate((router, engine)):
        # Token ids, not chat: no template prefix that a tenant's earlier requests cached already.
        body = {"model": "tiny", "prompt": [(37 * j + 11 * i) % 500 + 20 for j in range(32)], "max_tokens": 2}

        def cached(key: str, extra: dict | None = None) -> int:
            r = httpx.post(server.url("/v1/completions"), json={**body, **(extra or {})}, headers=_auth(key),
                           timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached(KEY) == 0
        assert cached(KEY2) == 0  # the same prompt, another tenant: nothing of KEY's is visible
        assert cached(KEY) > 0 and cached(KEY2) > 0
        assert cached(KEY, {"cache_salt": "my-own-split"}) == 0  # a tenant may split its own traffic
        # A salt that names another tenant's does not reach its blocks either.
        from kvmesh.engine.api.auth import tenant_salt

        assert cached(KEY, {"cache_salt": tenant_salt(KEY2)}) == 0


@pytest.fixture(scope="module")
def pd(tmp_path_factory, fleet):
    """A prefill and a decode engine holding the fleet's token, and a decode engine holding another."""
    d = tmp_path_factory.mktemp("pd-auth")
    (d / "token").write_text(TOKEN + "\n")
    (d / "other").write_text("another-deployments-token\n")
    model = make_tiny_hf_model("llama", d / "model")
    common = ("--model", str(model), "--served-model-name", "tiny", "--dtype", "float32", "--block-size", "4",
              "--num-kv-blocks", "128", "--max-model-len", "256")
    procs = []
    try:
        for role, token in (("prefill", "token"), ("decode", "token"), ("decode", "other")):
            procs.append(ServerProcess(*common, "--role", role, "--auth-token-file", str(d / token)).start())
        yield procs
    finally:
        for p in procs:
            p.stop()


def _transfer_port(decode: ServerProcess, token: str) -> int:
    return httpx.get(decode.url("/kv/info"), headers=_auth(token), timeout=10).json()["transfer_port"]


def test_a_kv_handoff_needs_both_engines_to_hold_the_same_token(pd):
    prefill, decode, stranger = pd
    body = dict(BODY, max_tokens=6, ignore_eos=True)
    kvp = {"transfer_id": "t-ok", "decode_host": "127.0.0.1", "decode_port": _transfer_port(decode, TOKEN)}
    r = httpx.post(prefill.url("/v1/chat/completions"), json={**body, "kv_transfer_params": kvp},
                   headers=_auth(TOKEN), timeout=60)
    assert r.status_code == 200, r.text
    out = httpx.post(decode.url("/v1/chat/completions"), json={**body, "kv_transfer_params": {"transfer_id": "t-ok"}},
                     headers=_auth(TOKEN), timeout=60)
    alone = httpx.post(decode.url("/v1/chat/completions"), json=body, headers=_auth(TOKEN), timeout=60)
    assert out.status_code == 200 and out.json()["choices"][0]["message"] == alone.json()["choices"][0]["message"]
    # The stranger's UCX port holds another token: the prefill engine refuses to hand it KV.
    port = _transfer_port(stranger, "another-deployments-token")
    kvp = {"transfer_id": "t-no", "decode_host": "127.0.0.1", "decode_port": port}
    r = httpx.post(prefill.url("/v1/chat/completions"), json={**body, "kv_transfer_params": kvp},
                   headers=_auth(TOKEN), timeout=60)
    assert r.status_code == 502 and "internal token" in r.json()["error"]["message"], r.text
    assert stranger.metric("kvmesh_kv_transfers_reserved") == 0  # nothing was reserved on it
    assert httpx.get(prefill.url("/ready"), timeout=10).status_code == 200  # and the prefill engine serves on
