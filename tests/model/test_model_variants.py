"""The Llama-family forward against transformers' own implementation of each
supported config, on tiny random-weight models (fast: no real checkpoint).

Each case runs a prompt as two prefill chunks (the second attends to the paged
prefix of the first) and then one decode step, and compares logits at every
position with a single full forward in transformers.
"""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine.model.attention import AttentionBackend, AttnMetadata
from kvmesh.engine.model.llama import LlamaModel
from kvmesh.engine.model.safetensors_loader import load_safetensors_dir

from tests.support.tiny_models import make_tiny_hf_model

CASES = {
    "llama": ("llama", {}),
    "llama3-rope-scaling": ("llama", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),  # the tiny models are untied by default
    "mistral": ("mistral", {}),
    "qwen2-qkv-bias": ("qwen2", {}),
    "qwen3-qk-norm": ("qwen3", {}),
}


def _meta(start: int, n: int, block_size: int, num_blocks: int) -> AttnMetadata:
    positions = torch.arange(start, start + n)
    table = torch.arange(num_blocks, dtype=torch.int32).unsqueeze(0)
    slots = table[0, positions // block_size].long() * block_size + positions % block_size
    return AttnMetadata(
        positions=positions, slot_mapping=slots,
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([start + n], dtype=torch.int32), block_tables=table,
        num_decodes=1 if n == 1 else 0, max_seq_len=start + n, max_query_len=n,
    ).finalize()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("block_size", [1, 16])
def test_forward_matches_transformers(tmp_path, case, block_size):
    from transformers import AutoModelForCausalLM

    arch, overrides = CASES[case]
    path = make_tiny_hf_model(arch, tmp_path, **overrides)
    config, weights = load_safetensors_dir(path, torch.float32)
    model = LlamaModel(config, weights, AttentionBackend("torch"), torch.float32, torch.device("cpu"),
                       max_position=256)
    ids = torch.randint(3, config.vocab_size, (41,), generator=torch.Generator().manual_seed(0))
    num_blocks = -(-len(ids) // block_size) + 1
    kv = torch.zeros(config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim)

    chunks = [(0, 23), (23, 17), (40, 1)]  # two prefill chunks, then one decode step
    ours = []
    for start, n in chunks:
        hidden = model.forward(ids[start:start + n], _meta(start, n, block_size, num_blocks), kv)
        ours.append(model.compute_logits(hidden))
    ours = torch.cat(ours)

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = hf(ids.unsqueeze(0)).logits[0].float()
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)
