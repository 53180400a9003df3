"""The router in front of two real engines on the default model (slow).

Real: two `kvmesh serve` processes (default model, one thread each, a small KV pool so
prompts evict each other; one publishing KV events in kvmesh's layout, one in llm-d's), their KV
event publishers and /kv routes, and a `kvmesh router`
process with the real tokenizer, subscribers, index and policy. Nothing is faked.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from kvmesh.engine.util.metrics import parse_samples, sample_value
from kvmesh.engine.util.localproc import free_port_pair
from tests.support.processes import RouterProcess, ServerProcess

pytestmark = pytest.mark.slow  # a router and real engines on the default model: about a minute

SYSTEM = ("You are a meticulous assistant for a company that builds routers for language model fleets. "
          "Answer precisely, cite the relevant block of the manual, and never invent configuration flags. ")


@pytest.fixture(scope="module")
def fleet():
    # The second engine publishes in llm-d's layout (kv@<pod>@<model> topics, token ids): the router
    # reads both formats, so every test below also checks it indexes and routes a mixed fleet.
    formats = [(), ("--kv-events-format", "llm-d", "--kv-events-token-ids", "--kv-events-pod", "engine-b")]
    engines = [ServerProcess("--num-threads", "1", "--num-kv-blocks", "96", "--max-num-seqs", "8",
                             "--kv-events-port", str(free_port_pair()), *fmt) for fmt in formats]
    router = None
    try:
        for e in engines:
            e.start()
        router = RouterProcess("--engines", ",".join(e.base_url for e in engines), "--policy", "cache-aware",
                               "--health-interval-s", "0.5").start()
        yield engines, router
    finally:
        for p in ([router] if router else []) + engines:
            p.stop()


def index_blocks(router: RouterProcess) -> dict[tuple[str, str], float]:
    samples = parse_samples(httpx.get(router.url("/metrics"), timeout=10).text)
    return {(dict(ls)["engine"], dict(ls)["tier"]): v for (n, ls), v in samples.items()
            if n == "kvmesh_router_index_blocks"}


def engine_blocks(engine: ServerProcess) -> dict[str, int]:
    snap = httpx.get(engine.url("/kv/snapshot"), timeout=10).json()
    return {t: len(hs) for t, hs in snap["tiers"].items()}


def wait_for(pred, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def chat(router: RouterProcess, system: str, question: str) -> dict:
    r = httpx.post(router.url("/v1/chat/completions"), timeout=300, json={
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def routed_to(router: RouterProcess, engines) -> dict[str, float]:
    samples = parse_samples(httpx.get(router.url("/metrics"), timeout=10).text)
    return {e.base_url: sample_value(samples, "kvmesh_router_requests_total", engine=e.base_url, outcome="ok") or 0
            for e in engines}


def test_engines_started_without_a_dtype_run_what_this_cpu_computes_natively(fleet):
    """`--dtype auto` is the default: the engines report the dtype the rule picks for this CPU."""
    from kvmesh.engine.dtype_choice import choose_dtype, cpu_flags

    want = choose_dtype("auto", "cpu", cpu_flags()).dtype
    for e in fleet[0]:
        samples = parse_samples(httpx.get(e.url("/metrics"), timeout=10).text)
        info = [dict(ls) for (n, ls), v in samples.items() if n == "kvmesh_engine_info" and v == 1]
        assert len(info) == 1 and info[0]["dtype"] == want and info[0]["dtype_source"] == "auto", info
        assert httpx.get(e.url("/kv/info"), timeout=10).json()["dtype"] == want


def test_a_request_sharing_a_long_prefix_goes_to_the_engine_that_cached_it(fleet):
    engines, router = fleet
    system = SYSTEM * 6  # several hundred tokens: many full blocks
    first = chat(router, system, "What is a block hash?")
    before = routed_to(router, engines)
    (holder,) = [u for u, n in before.items() if n == 1]
    wait_for(lambda: index_blocks(router).get((holder, "gpu"), 0) > 10, what="the first prompt's blocks in the index")
    second = chat(router, system, "And what is a prefix cache?")
    after = routed_to(router, engines)
    assert after[holder] == 2, (before, after)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 10 * 16


def test_index_size_equals_the_engines_cached_blocks_after_evictions(fleet):
    engines, router = fleet
    # 96-block pools; each prompt holds ~30 blocks (~500 tokens), so later prompts evict earlier ones.
    stored = 0
    for i in range(8):
        answer = chat(router, f"Conversation {i}: " + SYSTEM * 14, f"Question number {i}?")
        stored += answer["usage"]["prompt_tokens"] // 16
    assert stored > 2 * 96  # more distinct blocks than both pools hold: evictions happened

    def mirrored() -> bool:
        idx = index_blocks(router)
        return all(idx.get((e.base_url, t), 0) == n for e in engines for t, n in engine_blocks(e).items())

    wait_for(mirrored, what="index size == engines' cached blocks")
    total_index = sum(index_blocks(router).values())
    assert total_index == sum(sum(engine_blocks(e).values()) for e in engines)
    assert 0 < total_index <= 2 * 96


def test_a_draining_engine_finishes_its_stream_and_the_router_stops_sending_to_it(fleet):
    """Drain as the autoscaler does it (POST /admin/drain): the engine's in-flight stream runs to
    its end, /ready turns 503, the router's probe takes the engine out, and new requests all go
    to the other engine. Runs last in this module: the drained engine stays drained."""
    engines, router = fleet
    draining, other = engines
    body = {"prompt": "Once upon a time", "max_tokens": 48, "temperature": 0, "ignore_eos": True, "stream": True}
    chunks = 0
    with httpx.Client(timeout=300) as client, client.stream("POST", draining.url("/v1/completions"), json=body) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                chunks += 1
                break
        assert httpx.post(draining.url("/admin/drain"), timeout=10).status_code == 202
        assert httpx.get(draining.url("/ready"), timeout=10).status_code == 503
        finish = None
        for line in lines:
            if line.startswith("data: {"):
                chunks += 1
                finish = httpx.Response(200, content=line[6:]).json()["choices"][0]["finish_reason"] or finish
    assert finish == "length" and chunks >= 2  # the admitted request was not cut
    wait_for(lambda: parse_samples(httpx.get(router.url("/metrics"), timeout=10).text)
             .get(("kvmesh_router_engines_healthy", frozenset())) == 1, what="the router to take the engine out")
    before = routed_to(router, engines)
    for i in range(4):
        chat(router, SYSTEM, f"After the drain, question {i}?")
    after = routed_to(router, engines)
    assert after[draining.base_url] == before[draining.base_url]
    assert after[other.base_url] == before[other.base_url] + 4
    status = httpx.get(draining.url("/admin/drain"), timeout=10).json()
    assert status["in_flight"] == 0, status


def test_oversized_bodies_get_413_from_the_router_and_the_engines_and_nothing_breaks(fleet):
    """Both processes cap request bodies (--max-request-bytes, 4 MiB by default) with a 413 in
    OpenAI's format, whether the size is announced or the body streams in chunks; the router
    forwards nothing, and both serve the next request."""
    engines, router = fleet
    big = {"model": "default", "prompt": "x" * (5 << 20), "max_tokens": 1}
    raw = json.dumps(big).encode()

    def chunked():
        for i in range(0, len(raw), 1 << 16):
            yield raw[i:i + (1 << 16)]

    before = routed_to(router, engines)
    for proc in (router, engines[0]):
        for content in (raw, chunked()):
            r = httpx.post(proc.url("/v1/completions"), content=content, timeout=60,
                           headers={"content-type": "application/json"})
            assert r.status_code == 413, (proc.base_url, r.status_code, r.text[:200])
            assert r.json()["error"]["code"] == "request_too_large"
    assert routed_to(router, engines) == before
    assert engines[0].metric("kvmesh_request_errors_total", code="request_too_large") == 2
    assert chat(router, "You are brief.", "Say hi.")["usage"]["completion_tokens"] == 4


def test_a_router_that_cannot_read_the_model_takes_the_tokenizer_from_an_engine(fleet, tmp_path):
    """As under the operator with a Volume or URI model the router pod does not mount: the
    router's own tokenizer source fails, so it asks an engine (GET /kv/tokenizer), is not ready
    before it has one, and then routes by prefix with ids equal to the engines'."""
    engines, router = fleet
    fetched = RouterProcess("--engines", ",".join(e.base_url for e in engines), "--policy", "cache-aware",
                            "--model-path", str(tmp_path / "not-mounted"), "--health-interval-s", "0.5")
    try:
        fetched.start()  # waits for /ready 200: only once the tokenizer came
        ready = httpx.get(fetched.url("/ready"), timeout=10).json()
        info = httpx.get(engines[0].url("/kv/info"), timeout=10).json()
        assert ready["tokenizer"] == info["tokenizer"] == router_tokenizer(router), (ready, info)
        assert ready["tokenizer_problem"] is None and ready["mismatches"] == {}
        assert "takes it from the first healthy engine" in fetched.log_path.read_text()

        system = "Conversation about fetched tokenizers. " + SYSTEM * 6
        first_before = routed_to(router, engines)
        chat(router, system, "What is a block hash?")  # cached on one engine, through the first router
        (holder,) = [u for u, n in routed_to(router, engines).items() if n == first_before[u] + 1]
        wait_for(lambda: index_blocks(fetched).get((holder, "gpu"), 0) > 10, what="the prompt's blocks in the index")
        before = routed_to(fetched, engines)
        second = chat(fetched, system, "And what is a prefix cache?")
        assert routed_to(fetched, engines)[holder] == before[holder] + 1
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 10 * 16
    finally:
        fetched.stop()


def router_tokenizer(router: RouterProcess) -> str:
    return httpx.get(router.url("/ready"), timeout=10).json()["tokenizer"]


def test_the_router_tokenizes_exactly_as_the_engines_do(fleet):
    """The router answers /tokenize with the tokenizer it took from the engines: the same tokens,
    count and context length as an engine gives for the same body, for a prompt, a chat and a chat
    with tools (whose definitions the prompt carries)."""
    engines, router = fleet
    bodies = [{"prompt": SYSTEM + "How are blocks hashed?", "return_token_strs": True},
              {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]},
              {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [{"type": "function",
               "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
                   "city": {"type": "string"}}}}}]}]
    for body in bodies:
        mine = httpx.post(router.url("/tokenize"), json=body, timeout=30)
        theirs = httpx.post(engines[0].url("/tokenize"), json=body, timeout=30)
        assert mine.status_code == theirs.status_code == 200 and mine.json() == theirs.json()
    ids = theirs.json()["tokens"]
    assert (httpx.post(router.url("/detokenize"), json={"tokens": ids}, timeout=30).json()
            == httpx.post(engines[1].url("/detokenize"), json={"tokens": ids}, timeout=30).json())
