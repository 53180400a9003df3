"""The router in front of a real hybrid engine: predicted cached tokens equal the engine's.

Real: a `kvmesh serve` process on a tiny random Qwen3.5 text model (transformers-written weights,
fp32, block size 4, a checkpoint every 16 tokens, a 24-entry checkpoint pool that a long prompt empties, so checkpoints are
evicted while their KV stays), its KV event publisher and `/kv` routes, and a `kvmesh router`
process (real tokenizer, subscriber, index, policy and honesty histogram). Nothing is faked.
Greedy parity of this model with transformers is held by tests/engine/test_hybrid_*.py.
"""

from __future__ import annotations

import time

import httpx
import pytest

from kvmesh.engine.block_hash import hash_blocks, max_hit_blocks
from kvmesh.engine.model.recurrent_state import StatePool
from kvmesh.engine.model.safetensors_loader import read_hf_config
from kvmesh.engine.router.prompt import matched_tokens
from kvmesh.engine.util.localproc import free_port_pair
from kvmesh.engine.util.metrics import parse_samples, sample_value
from tests.support.processes import RouterProcess, ServerProcess
from tests.support.tiny_hybrid import make_tiny_hybrid_model

pytestmark = pytest.mark.slow  # two processes and a model load: about a minute here

BS = 4
ERR = "kvmesh_router_cached_tokens_prediction_error"
QUESTIONS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.",
             "Name three prime numbers below twenty.", "Why is the sky blue on a clear day?",
             "Summarise everything said so far."]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    model = make_tiny_hybrid_model(tmp_path_factory.mktemp("hybrid-route"))
    ckpt_bytes = 24 * StatePool.bytes_per_slot(read_hf_config(model), 4)
    engine = ServerProcess("--model", str(model), "--served-model-name", "tiny-hybrid", "--dtype", "float32",
                           "--block-size", str(BS), "--num-kv-blocks", "512", "--state-checkpoint-interval", "16",
                           "--state-checkpoint-bytes", str(ckpt_bytes), "--kv-events-port", str(free_port_pair()))
    router = None
    try:
        engine.start()
        router = RouterProcess("--engines", engine.base_url, "--policy", "cache-aware", "--model-path", str(model),
                               "--health-interval-s", "0.5").start()
        yield engine, router
    finally:
        for p in ([router] if router else []) + [engine]:
            p.stop()


def _in_sync(engine: ServerProcess, router: RouterProcess) -> bool:
    """The router's index holds exactly the engine's blocks and checkpoints (the engine is idle)."""
    snap = httpx.get(engine.url("/kv/snapshot"), timeout=10).json()["tiers"]
    samples = parse_samples(httpx.get(router.url("/metrics"), timeout=10).text)
    return all((sample_value(samples, "kvmesh_router_index_blocks", engine=engine.base_url, tier=t) or 0) == len(hs)
               for t, hs in snap.items())


def _wait_in_sync(engine: ServerProcess, router: RouterProcess, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not _in_sync(engine, router):
        assert time.monotonic() < deadline, "the router's index never caught up with the engine"
        time.sleep(0.1)


def _kv_only_prediction(engine: ServerProcess, router: RouterProcess, messages: list[dict]) -> int:
    """What the router would predict counting cached KV blocks alone (the pre-hybrid scorer)."""
    ids = httpx.post(router.url("/tokenize"), json={"messages": messages}, timeout=30).json()["tokens"]
    info = httpx.get(engine.url("/kv/info"), timeout=10).json()
    gpu = {bytes.fromhex(h) for h in httpx.get(engine.url("/kv/snapshot"), timeout=10).json()["tiers"]["gpu"]}
    hashes = hash_blocks(ids, BS, bytes.fromhex(info["extra_key"]))[:max_hit_blocks(len(ids), BS, whole=False)]
    run = next((i for i, h in enumerate(hashes) if h not in gpu), len(hashes))
    return matched_tokens(run, BS, len(ids))


def test_multi_turn_chat_predictions_are_exact(fleet):
    """Two interleaved multi-turn chats through the router, once pushed out of the checkpoint pool
    by a long unrelated prompt: every request's predicted cached
    tokens equal the engine's ``cached_tokens`` (the histogram's every observation is 0), later
    turns do hit, and at least one would be over-predicted by the KV blocks alone."""
    engine, router = fleet
    info = httpx.get(engine.url("/kv/info"), timeout=10).json()
    assert info["hybrid"] is True and info["state_checkpoints"]["medium"] == "state-gpu"
    chats = {"a": [{"role": "system", "content": "You answer briefly."}],
             "b": [{"role": "system", "content": "You are a careful assistant for a routing team."}]}
    cached, kv_only_over = [], 0
    filler = {"role": "user", "content": " ".join(f"word{i}" for i in range(120))}
    for turn, question in enumerate(QUESTIONS):
        if turn == 2:  # a long unrelated prompt: its captures evict every checkpoint, not the chats' KV
            chats["filler"] = [filler]
        elif turn == 3:
            del chats["filler"]
        for name, messages in chats.items():
            messages.append({"role": "user", "content": f"{name} {question}"})
            _wait_in_sync(engine, router)
            kv_only = _kv_only_prediction(engine, router, messages)
            r = httpx.post(router.url("/v1/chat/completions"), timeout=300, json={
                "model": "tiny-hybrid", "messages": messages, "max_tokens": 10, "temperature": 0})
            assert r.status_code == 200, r.text
            body = r.json()
            got = body["usage"]["prompt_tokens_details"]["cached_tokens"]
            cached.append(got)
            kv_only_over += kv_only > got
            messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    samples = parse_samples(httpx.get(router.url("/metrics"), timeout=10).text)
    n = len(QUESTIONS) * 2 + 1
    assert sample_value(samples, ERR + "_count") == n
    assert sample_value(samples, ERR + "_bucket", le="0.0") == n, "some prediction was too high"
    assert sample_value(samples, ERR + "_bucket", le="-1.0") == 0, "some prediction was too low"
    assert sum(c > 0 for c in cached) >= 2, cached
    assert kv_only_over >= 1, cached
