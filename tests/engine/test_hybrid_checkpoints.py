"""Prefix hits on a hybrid model through recurrent-state checkpoints, against transformers fp32.

Real: the whole engine on a tiny random Qwen3_5ForCausalLM written by transformers (KV blocks
for the attention layer, state slots and checkpoints for the DeltaNet layers), and
transformers' generate on the full prompt as the reference for every turn.
"""

from __future__ import annotations

import pytest

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.llm import LLM
from kvmesh.engine.model.recurrent_state import StatePool
from kvmesh.engine.model.safetensors_loader import read_hf_config
from tests.support.tiny_hybrid import PROMPT, SUFFIX, TURN1, TURN2, hf_greedy
from tests.support.tiny_hybrid import greedy as _params



def _engine(hybrid_dir, **cfg) -> LLMEngine:
    cfg = {"num_kv_blocks": 256, **cfg}
    return LLMEngine(EngineConfig(model=str(hybrid_dir), dtype="float32", **cfg), debug_checks=True)


def _computed_per_request(engine: LLMEngine) -> dict[str, int]:
    """Spy on the runner: tokens each request actually ran through the model."""
    computed: dict[str, int] = {}
    execute = engine.runner.execute

    def spy(out, block_ids, plan=None):
        for s in out.seqs:
            computed[s.request.request_id] = computed.get(s.request.request_id, 0) + s.num_new_tokens
        return execute(out, block_ids, plan)

    engine.runner.execute = spy
    return computed


@pytest.mark.parametrize("cfg", [
    {},  # default interval: checkpoints at the prompt's end and the generation's end only
    {"state_checkpoint_interval": 16},  # every block
    {"max_num_batched_tokens": 23, "state_checkpoint_interval": 32},  # captures inside chunks
    # captures 1, 2 and 3 tokens into a chunk: the conv state there reaches back into the chunk before
    {"max_num_batched_tokens": 31, "state_checkpoint_interval": 32},
])
def test_second_turn_computes_only_the_suffix(hybrid_dir, hybrid_turns, cfg):
    """Turn 2 = turn 1's prompt + its output + a suffix: it resumes from turn 1's last checkpoint
    (96 tokens: the last block boundary turn 1 computed) and computes only the rest."""
    first, second_prompt, second = hybrid_turns
    engine = _engine(hybrid_dir, **cfg)
    computed = _computed_per_request(engine)
    llm = LLM(engine=engine)
    r1 = llm.generate([PROMPT], _params(TURN1))[0]
    assert r1.token_ids == first
    r2 = llm.generate([second_prompt], _params(TURN2))[0]
    assert r2.token_ids == second, f"{r2.token_ids} != {second}"
    # turn 1 computed 70 + 40 - 1 = 109 tokens; its last full block (and checkpoint) ends at 96
    assert r2.num_cached_tokens == 96
    rid2 = next(k for k in computed if k != next(iter(computed)))
    assert computed[rid2] == len(second_prompt) - 96 + TURN2 - 1
    stats = engine.stats().state_checkpoints
    assert stats.restores == 1 and stats.reserve_failures == 0


def test_repeated_prompt_hits_the_prompt_checkpoint(hybrid_dir, hybrid_turns):
    """The same prompt again resumes from the checkpoint at its last block boundary."""
    first, _, _ = hybrid_turns
    llm = LLM(engine=_engine(hybrid_dir))
    llm.generate([PROMPT], _params(TURN1))
    again = llm.generate([PROMPT], _params(TURN1))[0]
    assert again.num_cached_tokens == (len(PROMPT) - 1) // 16 * 16
    assert again.token_ids == first


def test_checkpoints_off_means_no_hits(hybrid_dir, hybrid_turns):
    """With no checkpoint memory a hybrid model has no prefix hits, and is still exact."""
    _, second_prompt, second = hybrid_turns
    llm = LLM(engine=_engine(hybrid_dir, state_checkpoint_bytes=0))
    llm.generate([PROMPT], _params(TURN1))
    r2 = llm.generate([second_prompt], _params(TURN2))[0]
    assert r2.num_cached_tokens == 0 and r2.token_ids == second
    assert llm.engine.stats().state_checkpoints is None


def test_other_salt_gets_no_checkpoint(hybrid_dir):
    """Checkpoints are keyed by the salted chain: another tenant's identical prefix misses."""
    engine = _engine(hybrid_dir)
    engine.add_request("a", PROMPT, _params(2), cache_salt="tenant-a")
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("b", PROMPT, _params(2), cache_salt="tenant-b")
    cached = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            cached = out.num_cached_tokens
    assert cached == 0


def test_small_pool_evicts_and_stays_exact(hybrid_dir, hybrid_turns):
    """A pool of 3 checkpoints under two interleaved conversations evicts (LRU) and every turn
    still equals transformers; hits only where a checkpoint survived."""
    first, second_prompt, second = hybrid_turns
    per = StatePool.bytes_per_slot(read_hf_config(hybrid_dir), 4)
    engine = _engine(hybrid_dir, state_checkpoint_bytes=3 * per, state_checkpoint_interval=32)
    llm = LLM(engine=engine)
    other = [(7 * j) % 900 + 40 for j in range(60)]
    (other_ref, _), = hf_greedy(hybrid_dir, [other], 8)
    for _ in range(2):
        assert llm.generate([PROMPT], _params(TURN1))[0].token_ids == first
        assert llm.generate([other], _params(8))[0].token_ids == other_ref
        assert llm.generate([second_prompt], _params(TURN2))[0].token_ids == second
    stats = engine.stats().state_checkpoints
    assert stats.capacity == 3 and stats.evictions > 0 and stats.restores > 0


def test_preemption_resumes_from_checkpoints(hybrid_dir):
    """A KV pool too small for the batch preempts; re-admitted requests resume from their own
    checkpoints (or recompute) and equal transformers."""
    prompts = [PROMPT, PROMPT[:37] + SUFFIX, [(3 * j) % 900 + 20 for j in range(50)]]
    reference = hf_greedy(hybrid_dir, prompts, 24)
    engine = _engine(hybrid_dir, num_kv_blocks=12, max_num_batched_tokens=64, state_checkpoint_interval=16,
                     admission_reserve_tokens=0)
    results = LLM(engine=engine).generate(prompts, _params(24))
    assert engine.stats().num_preemptions > 0
    for res, (want, _) in zip(results, reference):
        assert res.token_ids == want


@pytest.mark.slow  # 512 generated tokens, checked against transformers
def test_second_turn_after_512_generated_tokens(hybrid_dir):
    """The multi-turn case the checkpoints are for: turn 1 generates 512 tokens, turn 2 extends its
    prompt and output by a short message and computes only the suffix after turn 1's last block."""
    prompt = PROMPT + PROMPT[:30]  # 100 tokens
    (first, _), = hf_greedy(hybrid_dir, [prompt], 512)
    second_prompt = prompt + first + SUFFIX + [12, 13]
    (second, _), = hf_greedy(hybrid_dir, [second_prompt], 16)
    engine = _engine(hybrid_dir, num_kv_blocks=512)
    computed = _computed_per_request(engine)
    llm = LLM(engine=engine)
    assert llm.generate([prompt], _params(512))[0].token_ids == first
    r2 = llm.generate([second_prompt], _params(16))[0]
    assert r2.token_ids == second
    assert r2.num_cached_tokens == (len(prompt) + 512 - 1) // 16 * 16 == 608
    assert list(computed.values())[-1] == len(second_prompt) - 608 + 16 - 1
