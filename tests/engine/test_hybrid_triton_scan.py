"""Greedy parity with transformers fp32 when the hybrid engine's gated delta rule runs the Triton kernels.

Real: the whole engine (scheduler, paged KV, state slots, checkpoints, sampler) on a tiny random
Qwen3_5ForCausalLM written by transformers, with the DeltaNet layers' chunked scan and decode step
run by the Triton kernels under Triton's CPU interpreter (TRITON_INTERPRET=1, tests/conftest.py),
and transformers' own generate as the reference. The engine picks the Triton set with the
Triton attention backend, which a CPU engine refuses: one test forces that backend (all kernels
in the interpreter), the other switches only the model's gated delta kernels after start-up.
"""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine.config import EngineConfig
from kvmesh.engine import engine as engine_module
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.kernels.gated_delta import gated_delta_kernels
from kvmesh.engine.llm import LLM
from kvmesh.engine.sampling import SamplingParams
from tests.support.tiny_hybrid import hf_greedy

MAX_NEW = 6
_g = torch.Generator().manual_seed(3)
# Short, longer than one 16-token KV block, and longer than a 64-token DeltaNet chunk.
PROMPTS = [torch.randint(3, 1000, (n,), generator=_g).tolist() for n in (5, 37, 70)]


@pytest.fixture(scope="module")
def reference(hybrid_dir):
    return hf_greedy(hybrid_dir, PROMPTS, MAX_NEW)


def _triton_llm(hybrid_dir, **cfg) -> LLM:
    engine = LLMEngine(EngineConfig(model=str(hybrid_dir), dtype="float32", num_kv_blocks=64, **cfg))
    assert engine.model.kernels.name == "torch"  # a CPU engine picks the reference
    engine.model.kernels = gated_delta_kernels("triton")
    return LLM(engine=engine)


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.mark.slow  # the interpreter runs every kernel program in Python: minutes on a loaded 2-core machine
def test_triton_scan_cold_then_checkpoint_hits(hybrid_dir, reference):
    """All prompts at once (one padded Triton scan, then batched Triton decode steps), then the same
    prompts again: they resume from checkpoints captured inside the Triton scan (the prompts' last
    block boundaries fall inside scan chunks). Both rounds equal transformers token for token."""
    llm = _triton_llm(hybrid_dir)
    first = llm.generate(PROMPTS, _params())
    assert [r.token_ids for r in first] == [want for want, _ in reference]
    again = llm.generate(PROMPTS, _params())
    assert [r.num_cached_tokens for r in again] == [(len(p) - 1) // 16 * 16 for p in PROMPTS]
    assert [r.token_ids for r in again] == [want for want, _ in reference]


@pytest.mark.slow  # the Triton scan in the interpreter over a whole prefill: about 15 s
def test_all_triton_engine_chunked_prefill(hybrid_dir, reference, monkeypatch):
    """The engine's own choice: with the Triton backend (forced here, since a CPU engine refuses it;
    its attention, RMSNorm and RoPE kernels then run in the interpreter too) the model gets the
    Triton gated delta kernels. A step budget of 23 tokens scans prompts in pieces that resume
    from slot state; tokens equal transformers'."""
    monkeypatch.setattr(engine_module, "_pick_backend", lambda cfg, device: "triton")
    engine = LLMEngine(EngineConfig(model=str(hybrid_dir), dtype="float32", num_kv_blocks=64,
                                    max_num_batched_tokens=23))
    assert engine.backend.name == "triton" and engine.model.kernels.name == "triton"
    results = LLM(engine=engine).generate(PROMPTS, _params())
    assert [r.token_ids for r in results] == [want for want, _ in reference]
