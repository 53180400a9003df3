"""`kvmesh serve --model DIR` on a hybrid (Qwen3.5 text) model, through the official `openai` client.

Real: the server process (`python -m kvmesh.engine.server`), the `openai` client, a tiny random
Qwen3_5ForCausalLM written by transformers. Expected outputs come from the offline engine in this
process, itself held to transformers token for token by tests/engine/test_hybrid_*.py.
"""

from __future__ import annotations

import openai
import pytest

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.sampling import SamplingParams
from tests.support.processes import ServerProcess
from tests.support.tiny_hybrid import make_tiny_hybrid_model

pytestmark = pytest.mark.slow  # a server process and two engines: tens of seconds

FLAGS = ("--dtype", "float32", "--block-size", "4", "--num-kv-blocks", "512", "--state-checkpoint-interval", "16")
TURN1 = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hybrid_model(tmp_path_factory.mktemp("hybrid-serve"))


@pytest.fixture(scope="module")
def server(model_dir):
    proc = ServerProcess("--model", str(model_dir), "--served-model-name", "tiny-hybrid", *FLAGS).start()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=300)


def test_chat_turns_match_offline_and_the_second_resumes_from_a_checkpoint(client, server, model_dir):
    """Two chat turns: each equals the offline engine's greedy text; the second reports cached
    prompt tokens (the first turn's prompt, restored from its state checkpoint), and the server's
    checkpoint metrics count that restore and the captures before it."""
    from kvmesh.engine.llm import LLM

    offline = LLM(EngineConfig(model=str(model_dir), dtype="float32", block_size=4, num_kv_blocks=512,
                               state_checkpoint_interval=16))
    params = SamplingParams(max_tokens=12, temperature=0.0)
    r1 = client.chat.completions.create(model="tiny-hybrid", messages=TURN1, temperature=0, max_tokens=12)
    want1 = offline.chat([TURN1], params)[0]
    assert r1.choices[0].message.content == want1.text
    turn2 = TURN1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "Paris is the capital of France."}]
    r2 = client.chat.completions.create(model="tiny-hybrid", messages=turn2, temperature=0, max_tokens=12)
    want2 = offline.chat([turn2], params)[0]
    assert r2.choices[0].message.content == want2.text
    assert r2.usage.prompt_tokens_details.cached_tokens > 0
    assert r2.usage.prompt_tokens_details.cached_tokens % 4 == 0  # a block boundary with a checkpoint
    gpu = {"tier": "gpu"}
    assert server.metric("kvmesh_state_checkpoint_restores_total", **gpu) == 1
    assert server.metric("kvmesh_state_checkpoint_stored_total", **gpu) >= 2  # both turns' prompt ends
    entries = server.metric("kvmesh_state_checkpoint_capacity_entries", **gpu)
    assert entries >= 1 and server.metric("kvmesh_state_checkpoint_used_entries", **gpu) >= 1
    assert server.metric("kvmesh_state_checkpoint_capacity_bytes", **gpu) % entries == 0
