"""The router end to end against fake engines.

Real: the router's ASGI app served by uvicorn (httptools) on loopback, its aiohttp upstream
connections, discovery probes, the policies, the prefix index and the metrics.
Fake: the engines (tests/support/fake_http_engine.py: scripted ASGI apps on real loopback servers), the
tokenizer (tests/support/fake_step_engine.py's byte tokenizer, standing in for the engines' own), and the
KV event subscriber (a stub that applies one fixed snapshot), so no model and no ZeroMQ are
involved. The real subscriber and real engines are covered by test_real_engines.py.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from kvmesh.engine.block_hash import hash_blocks, hit_tokens
from kvmesh.engine.kv.events import KVSnapshot
from kvmesh.engine.router.app import RouterApp, RouterSettings
from kvmesh.engine.router.discovery import Fleet
from kvmesh.engine.router.policies import LoadModel
from kvmesh.engine.router.proxy import forward_headers
from kvmesh.engine.util.metrics import parse_samples, sample_value
from tests.support.fake_step_engine import FakeTokenizer

from kvmesh.engine.util.asgi import ServerThread
from kvmesh.engine.util.localproc import free_port

from tests.support.waits import wait_for
from tests.support.fake_http_engine import BLOCK_SIZE, EXTRA, Behavior, FakeEngine, StubSubscriber


class Cluster:
    def __init__(self, policy: str, engines: list[FakeEngine], extra_urls=(), snapshots=None,
                 health_interval_s: float = 0.2, **settings):
        self.engines = engines
        self.servers = [ServerThread(e).start() for e in engines]
        for e, s in zip(engines, self.servers):
            e.url = s.url
        urls = [s.url for s in self.servers] + list(extra_urls)
        self.snapshots = snapshots or {}
        st = RouterSettings(policy=policy, engines=tuple(urls), health_interval_s=health_interval_s,
                            sync_timeout_s=10, **settings)

        def fleet(session):
            return Fleet(session, urls=list(urls), track_kv=True, health_interval_s=health_interval_s,
                         subscriber_factory=self._subscriber)

        self.app = RouterApp(st, FakeTokenizer(), fleet_factory=fleet)
        self.router = ServerThread(self.app).start()
        self.url = self.router.url

    def _subscriber(self, url, info, on_event, on_reset, session):
        snap = self.snapshots.get(url)
        return None if snap is None else StubSubscriber(snap, on_reset)

    def by_url(self, url):
        return next(e for e in self.engines if e.url == url)

    def stop(self):
        self.router.stop()
        for s in self.servers:
            s.stop()

    def metric(self, name, **labels):
        return sample_value(parse_samples(httpx.get(self.url + "/metrics").text), name, **labels)


@pytest.fixture
def cluster_factory():
    made = []

    def make(*args, **kwargs):
        c = Cluster(*args, **kwargs)
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()


def completion(url, prompt="hello world", stream=False, headers=None, **extra):
    return httpx.post(url + "/v1/completions", json={"model": "fake-model", "prompt": prompt, "stream": stream,
                                                     **extra}, headers=headers, timeout=30)


def sse_events(text):
    return [line[6:] for line in text.split("\n\n") if line.startswith("data: ")]


def test_proxies_completions_and_chat_streaming_and_not(cluster_factory):
    c = cluster_factory("round-robin", [FakeEngine("a"), FakeEngine("b")])
    assert httpx.get(c.url + "/ready").status_code == 200
    assert httpx.get(c.url + "/health").json() == {"status": "ok"}
    seen = {completion(c.url).json()["engine"] for _ in range(4)}
    assert seen == {"a", "b"}
    r = completion(c.url, stream=True, stream_options={"include_usage": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and [json.loads(e)["choices"][0]["text"] for e in events[:3]] == ["t0", "t1", "t2"]
    chat = httpx.post(c.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and chat.json()["engine"] in ("a", "b")
    assert httpx.get(c.url + "/v1/models").json()["data"][0]["id"] == "fake-model"
    missing = httpx.get(c.url + "/v2/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert httpx.get(c.url + "/v1/completions").status_code == 405
    assert c.metric("kvmesh_router_requests_total", policy="round-robin", engine=c.engines[0].url,
                    outcome="ok") >= 2
    assert c.metric("kvmesh_router_engines_healthy") == 2


def test_upstream_4xx_passes_through_unchanged_without_retry(cluster_factory):
    body = {"error": {"message": "prompt too long", "type": "invalid_request_error", "param": "messages",
                      "code": "context_length_exceeded"}}
    a = FakeEngine("a", Behavior(mode="status", status=400, body=body))
    c = cluster_factory("round-robin", [a])
    r = completion(c.url)
    assert r.status_code == 400 and r.json() == body
    assert len(a.requests) == 1
    assert c.metric("kvmesh_router_requests_total", policy="round-robin", engine=a.url, outcome="client_error") == 1


@pytest.mark.parametrize("failure", ["refused", "503", "die_before_first"])
@pytest.mark.parametrize("stream", [False, True])
def test_retries_on_another_engine_when_no_byte_reached_the_client(cluster_factory, failure, stream):
    good = FakeEngine("good")
    reason = {"refused": "connect", "503": "status", "die_before_first": "disconnect"}[failure]
    if failure == "refused":
        # Probes would take the refusing URL out between our forcing it back in and the request
        # (a race a loaded machine loses every round), so they run once, at the start.
        c = cluster_factory("round-robin", [good], extra_urls=[f"http://127.0.0.1:{free_port()}"],
                            health_interval_s=3600)
    else:
        bad = FakeEngine("bad", Behavior(mode="status", status=503) if failure == "503"
                         else Behavior(mode="die_before_first"))
        c = cluster_factory("round-robin", [bad, good])
    # Round-robin sends one of every two requests to the bad engine first. A refusing URL is out
    # after its first probe (or failed request), so it is forced back in before each request to
    # exercise the connect retry.
    for _ in range(6):
        if failure == "refused":
            for st in c.app.fleet.engines.values():
                st.healthy = True
        r = completion(c.url, stream=stream)
        assert r.status_code == 200
        text = r.text if stream else json.dumps(r.json())
        assert '"good"' in text and "error" not in text
        if (c.metric("kvmesh_router_retries_total", reason=reason) or 0) >= 1:
            break
    assert (c.metric("kvmesh_router_retries_total", reason=reason) or 0) >= 1


def test_engine_death_mid_stream_ends_with_an_error_event_and_done(cluster_factory):
    a = FakeEngine("a", Behavior(mode="die_midstream", chunks=5))
    c = cluster_factory("round-robin", [a])
    t0 = time.monotonic()
    r = completion(c.url, stream=True)
    assert time.monotonic() - t0 < 10
    events = sse_events(r.text)
    assert json.loads(events[0])["choices"][0]["text"] == "t0"
    assert json.loads(events[-2])["error"]["code"] == "upstream_failed"
    assert events[-1] == "[DONE]"
    assert c.metric("kvmesh_router_requests_total", policy="round-robin", engine=a.url,
                    outcome="failed_midstream") == 1


def wait_metric(c, name, want, timeout=10, **labels):
    """The router observes a request's end-to-end latency just after its last byte is out."""
    deadline = time.monotonic() + timeout
    while (c.metric(name, **labels) or 0) < want and time.monotonic() < deadline:
        time.sleep(0.02)
    return c.metric(name, **labels)


def test_end_to_end_ttft_and_tpot_are_what_the_client_saw(cluster_factory):
    a = FakeEngine("a", Behavior(chunks=4, chunk_interval_s=0.05))
    c = cluster_factory("round-robin", [a])
    ttft, tpot = "kvmesh_router_time_to_first_token_seconds", "kvmesh_router_time_per_output_token_seconds"
    assert c.metric(ttft + "_count", stream="true") == 0 and c.metric(tpot + "_count") == 0
    for _ in range(2):
        r = completion(c.url, stream=True, stream_options={"include_usage": True})
        assert r.status_code == 200 and sse_events(r.text)[-1] == "[DONE]"
    assert wait_metric(c, tpot + "_count", 2) == 2
    assert c.metric(ttft + "_count", stream="true") == 2
    # Token events 0.05 s apart: 3 gaps over usage.completion_tokens - 1 = 3.
    assert 0.04 * 2 <= c.metric(tpot + "_sum") <= 0.1 * 2
    assert completion(c.url).status_code == 200
    assert wait_metric(c, ttft + "_count", 1, stream="false") == 1
    assert c.metric(tpot + "_count") == 2  # a body that is not streamed has no token timing
    a.behavior = Behavior(mode="status", status=400)
    assert completion(c.url, stream=True).status_code == 400
    assert c.metric(ttft + "_count", stream="true") == 2  # only 200 responses are timed


def test_all_engines_down_is_a_503_with_a_message(cluster_factory):
    a = FakeEngine("a", Behavior(ready=False))
    c = cluster_factory("least-load", [a], extra_urls=[f"http://127.0.0.1:{free_port()}"])
    assert httpx.get(c.url + "/ready").status_code == 503
    r = completion(c.url)
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["code"] == "no_engine_available" and "no engine is available" in err["message"]
    assert r.headers["retry-after"] == "1"
    assert a.requests == []


def test_client_disconnect_aborts_the_upstream_request(cluster_factory):
    a = FakeEngine("a", Behavior(mode="slow", chunks=100))
    c = cluster_factory("round-robin", [a])
    with httpx.stream("POST", c.url + "/v1/completions", json={"prompt": "bye", "stream": True}, timeout=30) as r:
        for chunk in r.iter_bytes():
            if b"t0" in chunk:
                break
    deadline = time.monotonic() + 10
    while not a.aborted and time.monotonic() < deadline:
        time.sleep(0.05)
    assert a.aborted == ["bye"]
    assert c.metric("kvmesh_router_requests_total", policy="round-robin", engine=a.url, outcome="aborted") == 1


def test_cache_aware_sends_a_request_to_the_engine_holding_its_prefix(cluster_factory):
    prompt = "the long shared system prompt, then a question"
    ids = FakeTokenizer().encode(prompt)
    hashes = hash_blocks(ids, BLOCK_SIZE, EXTRA)
    events = {"port": 1, "replay_port": 2, "topic": "kv-events"}  # the stub subscriber never connects
    a, b = FakeEngine("a", kv_events=events), FakeEngine("b", Behavior(cached_tokens=32), kv_events=events)
    a_port, b_port = free_port(), free_port()  # URLs must be known before the snapshots
    snaps = {f"http://127.0.0.1:{a_port}": KVSnapshot(1, "a", {"gpu": frozenset(hashes[:2])}),
             f"http://127.0.0.1:{b_port}": KVSnapshot(1, "b", {"gpu": frozenset(hashes[:8]),
                                                               "cpu": frozenset(hashes[8:])})}
    c = Cluster.__new__(Cluster)
    servers = [ServerThread(a, a_port).start(), ServerThread(b, b_port).start()]
    try:
        a.url, b.url = servers[0].url, servers[1].url
        c.engines, c.servers, c.snapshots = [a, b], servers, snaps
        st = RouterSettings(policy="cache-aware", engines=(a.url, b.url), load=LoadModel(running_cost_tokens=1))

        def fleet(session):
            return Fleet(session, urls=[a.url, b.url], subscriber_factory=c._subscriber)

        c.app = RouterApp(st, FakeTokenizer(), fleet_factory=fleet)
        c.router = ServerThread(c.app).start()
        c.url = c.router.url
        assert httpx.get(c.url + "/ready").status_code == 200  # snapshots applied before ready
        for _ in range(3):
            assert completion(c.url, prompt).json()["engine"] == "b"
        other = completion(c.url, "something unrelated entirely").json()["engine"]
        assert other in ("a", "b")
        assert c.metric("kvmesh_router_index_blocks", engine=b.url, tier="gpu") == 8
        assert c.metric("kvmesh_router_index_blocks", engine=b.url, tier="cpu") == len(hashes) - 8
        # Predicted minus reported: b's 3 hits are off by predicted - 32; the other request by 0 or -32.
        # (A histogram with negative buckets exposes no _sum, so the buckets are checked.)
        predicted = hit_tokens(len(hashes), BLOCK_SIZE, len(ids))
        assert 1 < predicted - 32 <= 16
        err = "kvmesh_router_cached_tokens_prediction_error"
        assert c.metric(err + "_count") == 4
        assert c.metric(err + "_bucket", le="16.0") == 4 and c.metric(err + "_bucket", le="1.0") == 1
        assert c.metric("kvmesh_router_decision_latency_seconds_count") == 4
        # A long body is tokenized off the event loop; it routes by its prefix all the same.
        assert completion(c.url, prompt + " and more" * 1000).json()["engine"] == "b"
    finally:
        c.stop()


def test_streamed_requests_time_the_engines_prefill_from_queue_to_first_token(cluster_factory):
    """The dispatcher's invariant: queued prefill tokens count exactly the attempts without a
    first token yet, and each first token is a timed sample of the engine's prefill clock."""
    c = cluster_factory("cache-aware", [FakeEngine("a", Behavior(chunks=4, chunk_interval_s=0.01))])
    prompt = "x" * 200  # the byte tokenizer: about 200 uncached tokens
    r = completion(c.url, prompt, stream=True)
    assert r.status_code == 200 and len(sse_events(r.text)) == 5
    st = c.app.fleet.engines[c.engines[0].url]
    # The lease is released after the last byte went out, so the client may see the end first.
    wait_for(lambda: st.inflight == 0, "the stream's lease released", timeout=5)
    assert st.queued_prefill_tokens == 0 and st.prefill.busy_since is None
    assert 190 <= st.prefill.estimate.units <= 210 and st.prefill.estimate.seconds > 0
    completion(c.url, "y" * 200)  # not streamed: the whole body is the first token (another prompt: uncached)
    assert st.prefill.estimate.units > 300 and st.prefill.seconds_per_token() is not None
    assert c.metric("kvmesh_router_engine_prefill_seconds_per_token", engine=st.url) > 0


def test_session_policy_is_sticky_by_header_and_by_user(cluster_factory):
    c = cluster_factory("session", [FakeEngine("a"), FakeEngine("b")])
    first = completion(c.url, headers={"x-session-id": "s1"}).json()["engine"]
    assert all(completion(c.url, headers={"x-session-id": "s1"}).json()["engine"] == first for _ in range(4))
    u = completion(c.url, user="alice").json()["engine"]
    assert all(completion(c.url, user="alice").json()["engine"] == u for _ in range(4))


def test_tokenize_is_answered_by_the_router_with_the_engines_tokenizer(cluster_factory):
    """A prefix policy holds the engines' tokenizer, so /tokenize and /detokenize never reach an
    engine; the names and context length come from the engines' /kv/info."""
    engines = [FakeEngine("a"), FakeEngine("b")]
    c = cluster_factory("cache-aware", engines)
    tok = FakeTokenizer()
    msgs = [{"role": "user", "content": "hi"}]
    deadline = time.monotonic() + 10
    while (r := httpx.post(c.url + "/tokenize", json={"prompt": "hello"})).json().get("max_model_len") is None:
        assert time.monotonic() < deadline, r.text  # relayed until the engines' /kv/info is read
        time.sleep(0.1)
    engines[0].requests.clear()
    engines[1].requests.clear()
    assert httpx.post(c.url + "/tokenize", json={"model": "fake-model", "prompt": "hello"}).json() == {
        "count": 5, "max_model_len": 4096, "tokens": tok.encode("hello"), "token_strs": None}
    assert httpx.post(c.url + "/tokenize", json={"messages": msgs}).json()["tokens"] == tok.apply_chat_template(msgs)
    assert httpx.post(c.url + "/detokenize", json={"tokens": tok.encode("héllo")}).json() == {"prompt": "héllo"}
    bad = httpx.post(c.url + "/tokenize", json={"model": "other", "prompt": "x"})
    assert bad.status_code == 404 and bad.json()["error"]["code"] == "model_not_found"
    both = httpx.post(c.url + "/tokenize", json={"prompt": "x", "messages": msgs})
    assert both.status_code == 400 and "exactly one" in both.json()["error"]["message"]
    vocab = httpx.post(c.url + "/detokenize", json={"tokens": [10**6]})
    assert vocab.status_code == 400 and vocab.json()["error"]["param"] == "tokens"
    assert httpx.post(c.url + "/tokenize", content=b"{not json").json()["error"]["code"] == "invalid_json"
    assert httpx.get(c.url + "/tokenize").status_code == 405
    assert engines[0].requests == engines[1].requests == []


def test_tokenize_without_the_tokenizer_is_relayed_to_an_engine(cluster_factory):
    a = FakeEngine("a")
    c = cluster_factory("round-robin", [a])
    r = httpx.post(c.url + "/tokenize", json={"prompt": "hello"})
    assert r.status_code == 200 and a.requests == [{"prompt": "hello"}]


def test_the_proxy_sheds_with_429_when_every_engine_is_at_the_shed_limit(cluster_factory):
    """--shed-above-running 1: while the only engine streams one request, a second is answered 429
    (Retry-After) by the router without reaching the engine; once it ends, requests pass again."""
    import threading

    a = FakeEngine("a", Behavior(mode="slow", chunks=15))
    c = cluster_factory("round-robin", [a], load=LoadModel(shed_running=1))
    first = threading.Thread(target=completion, args=(c.url,), kwargs={"stream": True})
    first.start()
    wait_for(lambda: len(a.requests) == 1, "the first request on the engine")
    r = completion(c.url)
    assert r.status_code == 429 and r.json()["error"]["code"] == "engines_saturated" and r.headers["retry-after"] == "1"
    assert len(a.requests) == 1
    first.join(30)
    assert completion(c.url).status_code == 200
    assert c.metric("kvmesh_router_requests_total", policy="round-robin", engine="none", outcome="shed") == 1


def test_the_proxy_forwards_a_clients_headers_but_not_its_framing_nor_state_hints():
    """State hints are the router's to give (engine/router/app.py): a client's never reach an engine,
    whatever its case."""
    raw = [(b"Authorization", b"Bearer k"), (b"X-Kvmesh-State-Hints", b"16,32"), (b"Content-Length", b"9"),
           (b"x-session-id", b"s")]
    assert forward_headers(raw) == {"Authorization": "Bearer k", "x-session-id": "s"}
