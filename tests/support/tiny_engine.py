"""An in-process engine on the tiny random Llama, its fixtures, and transformers' greedy reference.

Real: the engine (every layer, the paged KV, the scheduler) and transformers' unpaged forward;
only the weights are random and small. ``model_dir`` and ``loaded`` are module-scoped fixtures
that a folder's conftest.py imports; ``tiny_engine`` copies the loaded weights so several engines
can share one load.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.llm import LLM
from kvmesh.engine.sampling import SamplingParams

from .tiny_models import make_tiny_hf_model

MAX_NEW = 8
BS = 4
PREFIX = [(11 * j) % 800 + 50 for j in range(40)]  # 10 full blocks
PROMPTS = [PREFIX + [(13 * i + 7 * j) % 900 + 20 for j in range(5 + i)] for i in range(3)]
OTHER = [[(17 * i + 5 * j) % 900 + 30 for j in range(48)] for i in range(3)]  # evicts PREFIX from a small pool


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf_model("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def loaded(model_dir):
    from kvmesh.engine.model.loader import load_model

    return load_model(str(model_dir), torch.float32)


def hf_greedy(model_dir, prompts: list[list[int]], max_new: int = MAX_NEW,
              banned: Callable[[list[int]], list[int]] | None = None) -> list[list[int]]:
    """transformers' greedy tokens, recomputing the whole unpaged sequence every step; `banned`
    (the tokens generated so far -> token ids) masks tokens before each argmax."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(max_new):
                logits = hf(torch.tensor([ids])).logits[0, -1]
                if banned is not None:
                    logits[banned(ids[len(prompt):])] = float("-inf")
                ids.append(int(logits.argmax()))
            out.append(ids[len(prompt):])
    return out


def tiny_engine(model_dir, loaded, **cfg) -> LLM:
    """An fp32 CPU engine (block size ``BS``, integrity checks after every step) over ``loaded``."""
    config = EngineConfig(model=str(model_dir), dtype="float32", device="cpu", block_size=BS, **cfg)
    return LLM(engine=LLMEngine(config, loaded=dataclasses.replace(loaded, weights=dict(loaded.weights)),
                                debug_checks=True))


def greedy(max_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
