"""Hybrid models on a cache node: attention KV blocks and recurrent-state checkpoints written
through by one engine are reloaded by another whose device pools are empty, against
transformers fp32; a checkpoint of another layout is refused by the node and counted.

Real: two engines on a tiny random Qwen3_5ForCausalLM written by transformers, a real
`kvmesh cache-node` process reached over UCX (``NodeProc``), a real ``KVClient`` for the forged
entry, ``debug_checks`` (pool, tier and checkpoint integrity after every step); transformers'
generate on the full prompt is the reference.
"""

from __future__ import annotations

import signal

import numpy as np
import pytest

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.llm import LLM
from kvmesh.engine.transfer.buffers import KVBlock
from kvmesh.engine.transfer.client import KVClient
from kvmesh.engine.transfer.header import BlockHeader, StateBufferSpec, state_layout
from tests.support.processes import NodeProc
from tests.support.tiny_hybrid import PROMPT, TURN1, TURN2
from tests.support.tiny_hybrid import greedy as _params
from tests.support.waits import wait_for

pytestmark = pytest.mark.timeout(300)



@pytest.fixture
def node():
    n = NodeProc(memory="64MiB", events=False).start()
    yield n
    n.stop(signal.SIGKILL)


def _engine(hybrid_dir, node) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model=str(hybrid_dir), dtype="float32", num_kv_blocks=64,
                                    cache_node=f"127.0.0.1:{node.http_port}", cache_node_timeout=10.0),
                       debug_checks=True)
    wait_for(lambda: engine._cache_node.clients() is not None, "the engine never resolved the cache node")
    return engine


def _node_stats(node) -> dict:
    with KVClient("127.0.0.1", node.ucx_port, timeout=10) as c:
        return c.stats().result(15)


def test_second_engine_reloads_kv_and_checkpoint(hybrid_dir, node, hybrid_turns):
    """Engine A runs turn 1 (checkpoints at 64 and, when it finishes, at 96 are written through
    with the KV blocks); engine B, empty, runs turn 2: it fetches 6 blocks and the 96-token
    checkpoint, computes only the rest, reports 96 cached tokens and equals transformers."""
    first, second_prompt, second = hybrid_turns
    writer = _engine(hybrid_dir, node)
    assert LLM(engine=writer).generate([PROMPT], _params(TURN1))[0].token_ids == first
    remote = writer.tiers.remote
    wait_for(lambda: remote.inflight_bytes == 0 and remote.state_stats.stored >= 2 and remote.snapshot_stats().stored >= 6,
             f"write-through did not store the checkpoints: {remote.state_stats}")
    assert remote.state_stats.dropped == 0 and remote.state_stats.failures == 0
    writer.close()

    reader = _engine(hybrid_dir, node)
    r2 = LLM(engine=reader).generate([second_prompt], _params(TURN2))[0]
    assert r2.token_ids == second, f"{r2.token_ids} != {second}"
    assert r2.num_cached_tokens == 96
    rt = reader.tiers.remote
    assert rt.state_stats.hits == 1 and rt.state_stats.failures == 0
    assert reader.state_slots.remote_promotions == 1 and rt.snapshot_stats().promotions == 6
    assert reader.stats().state_checkpoints.restores == 1
    node_row = reader.stats().state_tiers[-1]  # as the metrics report it
    assert (node_row.tier, node_row.stats.promotions, node_row.stats.hits) == ("remote", 1, 1)
    # The promoted prefix is local now: the same prompt again hits on the device.
    again = LLM(engine=reader).generate([second_prompt], _params(TURN2))[0]
    assert again.token_ids == second and again.num_cached_tokens >= 96
    reader.check_integrity()
    reader.close()


def test_checkpoint_of_another_layout_is_refused_and_counted(hybrid_dir, node, hybrid_turns):
    """A checkpoint stored under this engine's hash (the 48-token boundary, which the engine never
    checkpoints itself) with another recurrent-state shape: the node refuses to serve it to this
    engine (a header error naming the field, before any byte), the engine counts the failure,
    recomputes, and still equals transformers; its own write-through is unaffected."""
    first, _, _ = hybrid_turns
    engine = _engine(hybrid_dir, node)
    layout = engine.tiers.remote.state_layout
    specs = list(layout.state)
    i = next(j for j, s in enumerate(specs) if s.name.startswith("ssm."))
    specs[i] = StateBufferSpec(specs[i].name, specs[i].dtype, (*specs[i].shape[:-1], specs[i].shape[-1] + 1))
    wrong = state_layout(engine.tiers.remote.layout, specs)
    engine.kv.get_computed_blocks("probe", PROMPT)
    chain = engine.kv.block_hashes("probe")
    engine.kv.free("probe")
    with KVClient("127.0.0.1", node.ucx_port, timeout=10) as c:
        assert c.put([KVBlock(BlockHeader(wrong, chain[2], None), np.zeros(wrong.nbytes, np.uint8))]).result(15) \
            == ["stored"]
    res = LLM(engine=engine).generate([PROMPT], _params(TURN1))[0]
    assert res.token_ids == first and res.num_cached_tokens == 0
    remote = engine.tiers.remote
    wait_for(lambda: remote.inflight_bytes == 0 and remote.state_stats.stored >= 2, "write-through did not finish")
    st = remote.state_stats
    assert st.queries == 1 and st.failures == 1 and st.hits == 0 and st.dropped == 0
    assert engine.state_slots.remote_promotions == 0
    assert _node_stats(node)["rejected_headers"] == 1
    engine.check_integrity()
    engine.close()


def test_local_kv_with_the_checkpoint_only_on_the_node(hybrid_dir, node, hybrid_turns):
    """The hit mixes tiers: turn 1's KV blocks stay in the device pool, its checkpoints are
    evicted from a one-entry device checkpoint pool (no host tier) by another prompt; turn 2
    takes the KV from the device and the checkpoint from the node, and is exact. (With one entry
    turn 1 holds its generation-end checkpoint at 80 tokens: no entry was free for a later one.)"""
    from kvmesh.engine.model.recurrent_state import StatePool
    from kvmesh.engine.model.safetensors_loader import read_hf_config

    first, second_prompt, second = hybrid_turns
    per = StatePool.bytes_per_slot(read_hf_config(hybrid_dir), 4)
    engine = LLMEngine(EngineConfig(model=str(hybrid_dir), dtype="float32", num_kv_blocks=64,
                                    state_checkpoint_bytes=per, cache_node=f"127.0.0.1:{node.http_port}",
                                    cache_node_timeout=10.0), debug_checks=True)
    wait_for(lambda: engine._cache_node.clients() is not None, "the engine never resolved the cache node")
    llm = LLM(engine=engine)
    assert llm.generate([PROMPT], _params(TURN1))[0].token_ids == first
    other = [(5 * j) % 900 + 30 for j in range(40)]
    llm.generate([other], _params(2))  # its checkpoint takes the only device entry
    remote = engine.tiers.remote
    wait_for(lambda: remote.inflight_bytes == 0, "write-through did not finish")
    r2 = llm.generate([second_prompt], _params(TURN2))[0]
    assert r2.token_ids == second and r2.num_cached_tokens == 80
    assert engine.state_slots.remote_promotions == 1 and remote.snapshot_stats().promotions == 0
    engine.check_integrity()
    engine.close()
