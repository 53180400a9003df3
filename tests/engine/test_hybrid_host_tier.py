"""Hybrid models on the host tier: attention KV blocks and recurrent-state checkpoints evicted
from the device pools come back from host memory on a prefix hit, against transformers fp32.

Real: the whole engine on a tiny random Qwen3_5ForCausalLM written by transformers, its real
host KV tier (``HostTier``) and host checkpoint tier (``HostStateTier``) with real copies,
``debug_checks`` (pool, tier and checkpoint integrity after every step); transformers' generate
on the full prompt is the reference for every turn.
"""

from __future__ import annotations

import pytest

from kvmesh.engine.config import ConfigError, EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.llm import LLM
from kvmesh.engine.model.recurrent_state import StatePool
from kvmesh.engine.model.safetensors_loader import read_hf_config
from tests.support.tiny_hybrid import PROMPT, TURN1, TURN2, hf_greedy
from tests.support.tiny_hybrid import greedy as _params

OTHERS = [[(7 * j + 11 * i) % 900 + 40 for j in range(60)] for i in range(3)]


@pytest.fixture(scope="module")
def per(hybrid_dir) -> int:
    return StatePool.bytes_per_slot(read_hf_config(hybrid_dir), 4)


@pytest.fixture(scope="module")
def turns(hybrid_dir, hybrid_turns):
    """(turn-1 tokens, turn-2 prompt, turn-2 tokens, other prompts' tokens) from transformers."""
    return (*hybrid_turns, [t for t, _ in hf_greedy(hybrid_dir, OTHERS, 4)])


def _engine(hybrid_dir, **cfg) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(hybrid_dir), dtype="float32", **cfg), debug_checks=True)


def _run_turns(llm: LLM, turns) -> tuple:
    """Turn 1, then other prompts that push turn 1's KV and checkpoints out of the device pools,
    then turn 2 (turn 1 + its output + a suffix). Every output is checked against transformers."""
    first, second_prompt, second, others = turns
    assert llm.generate([PROMPT], _params(TURN1))[0].token_ids == first
    for prompt, want in zip(OTHERS, others):
        assert llm.generate([prompt], _params(4))[0].token_ids == want
    r2 = llm.generate([second_prompt], _params(TURN2))[0]
    assert r2.token_ids == second, f"{r2.token_ids} != {second}"
    return r2


def test_turn_two_reloads_kv_and_checkpoint_from_host(hybrid_dir, per, turns):
    """Device pools of 2 checkpoints and 12 KV blocks: the other prompts evict turn 1's state and
    blocks to the host tiers; turn 2 promotes both back, resumes at 96 tokens (turn 1's last
    boundary) and equals transformers."""
    engine = _engine(hybrid_dir, num_kv_blocks=12, state_checkpoint_bytes=2 * per, cpu_kv_bytes=4 << 20,
                     cpu_state_bytes=16 * per)
    host_states = engine.state_slots.host
    assert host_states is not None and host_states.num_slots == 16
    r2 = _run_turns(LLM(engine=engine), turns)
    assert r2.num_cached_tokens == 96
    assert host_states.stats.promotions == 1 and host_states.stats.stored >= 2
    kv_host = engine.stats().tiers[0]
    assert kv_host.tier == "cpu" and kv_host.stats.promotions > 0
    assert engine.stats().state_checkpoints.restores == 1
    gpu, cpu = engine.stats().state_tiers  # the media as the metrics report them
    assert (gpu.tier, gpu.stats.promotions, gpu.capacity_blocks, gpu.block_bytes) == ("gpu", 1, 2, per)
    assert (cpu.tier, cpu.stats.promotions, cpu.capacity_blocks, cpu.block_bytes) == ("cpu", 1, 16, per)
    assert cpu.stats.stored == host_states.stats.stored and cpu.used_blocks == host_states.used
    engine.check_integrity()


def test_without_host_checkpoints_the_kv_alone_is_no_hit(hybrid_dir, per, turns):
    """Control: the same traffic with a device checkpoint pool too small to keep turn 1's state
    and a host checkpoint tier of one entry that the others' checkpoints take: the host KV is
    there, no checkpoint is, so turn 2 is a miss (recomputed) and still exact."""
    engine = _engine(hybrid_dir, num_kv_blocks=12, state_checkpoint_bytes=2 * per, cpu_kv_bytes=4 << 20,
                     cpu_state_bytes=per)
    r2 = _run_turns(LLM(engine=engine), turns)
    host_states = engine.state_slots.host
    assert host_states.num_slots == 1 and host_states.stats.evictions > 0
    assert r2.num_cached_tokens == 0 and host_states.stats.promotions == 0


def test_host_checkpoint_budget_is_its_own(hybrid_dir, per):
    """The checkpoint tier's budget defaults to a quarter of the KV host tier's and is checked."""
    engine = _engine(hybrid_dir, num_kv_blocks=16, state_checkpoint_bytes=2 * per, cpu_kv_bytes=40 * per)
    assert engine.state_slots.host.num_slots == 10
    with pytest.raises(ConfigError, match="cpu-state-bytes"):
        _engine(hybrid_dir, num_kv_blocks=12, state_checkpoint_bytes=2 * per, cpu_kv_bytes=4 << 20,
                cpu_state_bytes=per - 1)
