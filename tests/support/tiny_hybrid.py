"""Tiny random Qwen3.5 text checkpoints (gated DeltaNet + gated attention) for hybrid-model tests.

`make_tiny_hybrid_model(tmp_path, **overrides)` saves a real transformers
`Qwen3_5ForCausalLM` (config.json + model.safetensors) with the tiny tokenizer of
tiny_models.py. Random weights give nearly flat logits, so the LM head is scaled
(`head_scale`) until greedy choices are not near ties and token-for-token parity with
transformers is a meaningful check.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.support.tiny_models import TINY_VOCAB, make_tiny_tokenizer

TINY_HYBRID: dict[str, Any] = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,  # linear, linear, linear, full
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
    tie_word_embeddings=False,
)


def make_tiny_hybrid_model(tmp_path: Path, *, seed: int = 0, head_scale: float = 8.0, with_tokenizer: bool = True,
                           name: str = "qwen3_5-tiny", **overrides: Any) -> Path:
    """Save a random Qwen3.5 text model under ``tmp_path/name``; return the directory.

    ``overrides`` go to ``Qwen3_5TextConfig`` (e.g. ``num_hidden_layers=8``, ``layer_types=[...]``).
    The same seed gives the same weights.
    """
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(**{**TINY_HYBRID, **overrides})
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    out = Path(tmp_path) / name
    model.save_pretrained(out)
    if with_tokenizer:
        make_tiny_tokenizer(min(config.vocab_size, TINY_VOCAB)).save_pretrained(out)
    return out


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new: int) -> list[tuple[list[int], torch.Tensor]]:
    """transformers' greedy tokens and per-step logits for each prompt (fp32, one prompt at a time)."""
    from transformers import Qwen3_5ForCausalLM

    model = Qwen3_5ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    refs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, min_new_tokens=max_new,
                                 do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=2,
                                 eos_token_id=None)
            refs.append((out.sequences[0, len(ids):].tolist(), torch.stack([s[0] for s in out.scores])))
    return refs


# The two-turn conversation the checkpoint tests share: turn 1 is PROMPT (70 tokens) and TURN1
# generated tokens; turn 2 is turn 1's prompt + its output + SUFFIX, TURN2 generated tokens.
PROMPT = torch.randint(3, 1000, (70,), generator=torch.Generator().manual_seed(4)).tolist()
SUFFIX = [5, 6, 7, 8, 9, 10, 11]
TURN1, TURN2 = 40, 12


def two_turns(model_dir: Path) -> tuple[list[int], list[int], list[int]]:
    """(turn-1 tokens, turn-2 prompt, turn-2 tokens), as transformers generates them."""
    (first, _), = hf_greedy(model_dir, [PROMPT], TURN1)
    second_prompt = PROMPT + first + SUFFIX
    (second, _), = hf_greedy(model_dir, [second_prompt], TURN2)
    return first, second_prompt, second


def greedy(n: int) -> Any:
    """Greedy sampling of exactly ``n`` tokens (EOS ignored), as the references are generated."""
    from kvmesh.engine.sampling import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
