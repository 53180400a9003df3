"""Prefix hits on a hybrid model through recurrent-state checkpoints, against transformers fp32.

Real: the whole engine on a tiny random Qwen3_5ForCausalLM written by transformers (KV blocks
for the attention layer, state slots and checkpoints for the DeltaNet layers), and
transformers' generate on the full prompt as the reference for every turn.
"""

from __future__ import annotations

import pytest
import torch

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


SHARED = torch.randint(3, 1000, (300,), generator=torch.Generator().manual_seed(11)).tolist()


def _tails(*lengths: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(12)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in lengths]


def test_the_third_prompt_sharing_a_prefix_shorter_than_the_interval_resumes_from_its_branch_point(hybrid_dir):
    """One 300-token system prompt, three users (20, 27, 34 more tokens), the default checkpoint
    interval (1024): prompt 2's KV hit (18 blocks) has no checkpoint, so its end becomes a branch
    point prompt 2 captures; prompt 3 resumes there (288 of 300 shared tokens). Exact throughout."""
    prompts = [SHARED + t for t in _tails(20, 27, 34)]
    refs = hf_greedy(hybrid_dir, prompts, 6)
    engine = _engine(hybrid_dir)
    assert engine.config.state_checkpoint_interval == 1024
    llm = LLM(engine=engine)
    got = [llm.generate([p], _params(6))[0] for p in prompts]
    assert [g.token_ids for g in got] == [want for want, _ in refs]
    assert got[1].num_cached_tokens == 0  # nothing at the divergence yet
    assert got[2].num_cached_tokens == 288 >= 0.9 * len(SHARED)
    assert engine.events.snapshot().hashes["branch"]  # subscribers (the router) hear of the branch point


def test_a_chat_prompt_checkpoints_at_its_system_messages_end(hybrid_dir):
    """Through the real server app (in process) on the real engine, and offline (``LLM.chat``): a
    chat request's earlier messages end where the next user's prompt leaves it, so the second chat
    sharing a system prompt resumes at the block before its end; every answer is transformers'."""
    from fastapi.testclient import TestClient

    from kvmesh.engine.server.app import ServerApp
    from kvmesh.engine.server.async_engine import AsyncEngine

    system = " ".join(f"rule {i}: answer in plain words and cite sources." for i in range(30))
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
             for q in ("What is the tallest mountain?", "Name three rivers in Europe.")]
    offline = LLM(engine=_engine(hybrid_dir))
    outs = [offline.chat([c], _params(6))[0] for c in chats]
    assert [o.token_ids for o in outs] == [t for t, _ in hf_greedy(hybrid_dir, [o.prompt_token_ids for o in outs], 6)]
    want = [o.text for o in outs]
    engine = _engine(hybrid_dir)
    sys_end = len(engine.tokenizer.apply_chat_template(chats[0][:1], add_generation_prompt=False))
    assert sys_end > 256
    assert outs[1].num_cached_tokens == sys_end // 16 * 16  # LLM.chat checkpoints there too
    with TestClient(ServerApp(AsyncEngine(lambda: engine)).app) as c:
        got = [c.post("/v1/chat/completions", json={"messages": m, "max_tokens": 6, "temperature": 0,
                                                    "ignore_eos": True}).json() for m in chats]
    assert [g["choices"][0]["message"]["content"] for g in got] == want
    cached = got[1]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == sys_end // 16 * 16 >= 0.9 * sys_end


def test_the_routers_hint_makes_another_engine_checkpoint_where_the_pools_prompts_diverge(hybrid_dir):
    """Both sides of the state-hints contract with the real code: the router's Fleet, fed engine
    a's KV snapshot (prompt 1's blocks, a checkpoint at its end), tells engine b computing prompt
    2 to checkpoint where a's cached prefix of it ends (288 tokens); b's server app reads the
    header, so prompt 3 resumes there on b. A malformed header is a 400 naming it."""
    from fastapi.testclient import TestClient

    from kvmesh.engine.api.params import STATE_HINTS_HEADER, format_state_hints
    from kvmesh.engine.router.discovery import EngineState, Fleet
    from kvmesh.engine.router.prompt import PromptInfo
    from kvmesh.engine.server.app import ServerApp
    from kvmesh.engine.server.async_engine import AsyncEngine

    prompts = [SHARED + t for t in _tails(20, 27, 34)]
    a, b = _engine(hybrid_dir), _engine(hybrid_dir)
    offline = LLM(engine=a)
    want = [r.text for r in offline.generate(prompts[:1], _params(6))]
    fleet = Fleet(session=None, urls=["http://a"])  # type: ignore[arg-type]  # no I/O in state_hints
    fleet.engines["http://a"] = EngineState("http://a", healthy=True, info={
        "engine_id": a.engine_id, "block_size": 16, "extra_key": a.kv.extra.hex(), "hybrid": True,
        "kv_events": {"port": 1}})
    fleet.index.reset("http://a", a.events.snapshot())
    hints = fleet.state_hints(PromptInfo(prompts[1], num_prompt_tokens=len(prompts[1])))
    assert hints == (288,)
    want += [r.text for r in offline.generate(prompts[1:], _params(6))]
    body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with TestClient(ServerApp(AsyncEngine(lambda: b)).app) as c:
        bad = c.post("/v1/completions", json={"prompt": prompts[1], **body}, headers={STATE_HINTS_HEADER: "12,x"})
        assert bad.status_code == 400 and STATE_HINTS_HEADER in bad.json()["error"]["message"]
        r2 = c.post("/v1/completions", json={"prompt": prompts[1], **body},
                    headers={STATE_HINTS_HEADER: format_state_hints(hints)}).json()
        r3 = c.post("/v1/completions", json={"prompt": prompts[2], **body}).json()
    assert [r2["choices"][0]["text"], r3["choices"][0]["text"]] == want[1:]
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert r3["usage"]["prompt_tokens_details"]["cached_tokens"] == 288
