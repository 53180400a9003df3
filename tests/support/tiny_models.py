"""Tiny random Hugging Face checkpoints (2 layers, hidden 64, vocab 1000) for fast tests.

`make_tiny_hf_model(arch, tmp_path, **overrides)` saves a real transformers
model (config.json + model.safetensors) and, by default, a small byte-level BPE
tokenizer with a ChatML chat template, so a directory round-trips through
every kvmesh loader and can be compared against transformers itself.
`make_tiny_gguf(...)` writes the same kind of model as a GGUF file laid out as
llama.cpp's converter does (GGUF names, Q/K rows permuted for `llama` files).
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import numpy as np
import torch

TINY_VOCAB = 1000
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2

_BASE: dict[str, Any] = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
    tie_word_embeddings=False,
)

# Per-architecture defaults that exercise what makes each family different.
_ARCH: dict[str, dict[str, Any]] = {
    "llama": dict(rope_theta=500000.0),
    "mistral": dict(rope_theta=1000000.0, sliding_window=None),
    "qwen2": dict(rope_theta=1000000.0),  # q/k/v carry biases
    "qwen3": dict(rope_theta=1000000.0, head_dim=32),  # q/k RMSNorm; head_dim != hidden / heads
}

_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France. "
    "Key-value caches hold attention state for every token of a prompt. "
    "Naïve café déjà vu — 你好，世界。こんにちは 😀 🇫🇷 "
    "def add(a, b):\n    return a + b\n"
)


def _pseudo_words(n: int = 3000, seed: int = 1234) -> list[str]:
    """Deterministic made-up words: enough distinct pairs for BPE to fill a 1000-token vocabulary."""
    import random

    rng = random.Random(seed)
    letters = "etaoinshrdlucmfwypvbgkqjxz"
    return [" ".join("".join(rng.choices(letters[: rng.randint(6, 26)], k=rng.randint(2, 9))) for _ in range(12))
            for _ in range(n // 12)]


def _config(arch: str, overrides: dict[str, Any]) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    classes = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
    if arch not in classes:
        raise ValueError(f"no tiny model for arch {arch!r}; choose one of {', '.join(classes)}")
    # Config classes may edit dict arguments in place (rope_scaling gains rope_theta): pass copies.
    return classes[arch](**copy.deepcopy({**_BASE, **_ARCH[arch], **overrides}))


@functools.lru_cache(maxsize=4)
def _trained_bpe_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4 + _pseudo_words(), trainer=trainer)
    return tok.to_str()


def make_tiny_tokenizer(vocab_size: int = TINY_VOCAB) -> Any:
    """A byte-level BPE fast tokenizer (trained once per process on a fixed corpus) with ChatML special tokens."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_bpe_json(vocab_size)), bos_token="<|im_start|>",
        eos_token="<|im_end|>", unk_token="<|endoftext|>", pad_token="<|im_end|>",
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def make_tiny_hf_model(
    arch: str, tmp_path: Path, *, seed: int = 0, with_tokenizer: bool = True, dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> Path:
    """Save a random `arch` model (llama, mistral, qwen2, qwen3) under `tmp_path/<arch>-tiny`; return the dir.

    `overrides` go to the transformers config (e.g. `tie_word_embeddings=True`,
    `rope_scaling={...}`, `num_hidden_layers=3`). The same seed gives the same weights.
    """
    from transformers import AutoModelForCausalLM

    config = _config(arch, overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    out = Path(tmp_path) / f"{arch}-tiny"
    model.save_pretrained(out)
    if with_tokenizer:
        make_tiny_tokenizer(min(config.vocab_size, TINY_VOCAB)).save_pretrained(out)
    return out


# ---- GGUF ---------------------------------------------------------------------------------------------------------

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def gguf_name(hf: str) -> str:
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    _, _, idx, rest = hf.split(".", 3)
    return f"blk.{idx}.{_LAYER[rest]}"


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's rotary row permutation: each head's [half0 | half1] rows become interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add_tokenizer_metadata(w: Any) -> None:
    """Store the tiny byte-level BPE tokenizer and ChatML template the way llama.cpp does (`gpt2` model)."""
    import json

    model = json.loads(_trained_bpe_json(TINY_VOCAB))["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "default")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", [3 if t in SPECIAL_TOKENS else 1 for t in tokens])
    w.add_array("tokenizer.ggml.merges", merges)
    w.add_uint32("tokenizer.ggml.padding_token_id", 2)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_string("tokenizer.chat_template", CHATML_TEMPLATE)


def write_gguf(
    state: dict[str, torch.Tensor], hf_config: dict, arch: str, out: Path, qtype: str = "F32", name: str = "Tiny Test",
    with_tokenizer: bool = True,
) -> Path:
    """Write `state` (HF names) with `hf_config` metadata as a GGUF file of architecture `arch`."""
    import gguf

    n_head, n_kv = hf_config["num_attention_heads"], hf_config["num_key_value_heads"]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(name)
    w.add_uint32(f"{arch}.block_count", hf_config["num_hidden_layers"])
    w.add_uint32(f"{arch}.context_length", hf_config["max_position_embeddings"])
    w.add_uint32(f"{arch}.embedding_length", hf_config["hidden_size"])
    w.add_uint32(f"{arch}.feed_forward_length", hf_config["intermediate_size"])
    w.add_uint32(f"{arch}.attention.head_count", n_head)
    w.add_uint32(f"{arch}.attention.head_count_kv", n_kv)
    w.add_float32(f"{arch}.rope.freq_base", hf_config["rope_parameters"]["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", hf_config["rms_norm_eps"])
    w.add_uint32(f"{arch}.vocab_size", hf_config["vocab_size"])
    if hf_config.get("head_dim"):
        w.add_uint32(f"{arch}.attention.key_length", hf_config["head_dim"])
        w.add_uint32(f"{arch}.attention.value_length", hf_config["head_dim"])
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    if with_tokenizer:
        _add_tokenizer_metadata(w)
    quant = gguf.GGMLQuantizationType[qtype]
    for key, t in state.items():
        arr = t.detach().float().numpy().copy()
        if arch == "llama" and key.endswith(("q_proj.weight", "q_proj.bias")):
            arr = llamacpp_permute(arr, n_head)
        elif arch == "llama" and key.endswith(("k_proj.weight", "k_proj.bias")):
            arr = llamacpp_permute(arr, n_kv)
        if arr.ndim == 2 and quant != gguf.GGMLQuantizationType.F32:
            w.add_tensor(gguf_name(key), gguf.quants.quantize(arr, quant), raw_dtype=quant)
        else:
            w.add_tensor(gguf_name(key), arr.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def make_tiny_gguf(
    arch: str, tmp_path: Path, *, qtype: str = "F32", seed: int = 0, with_tokenizer: bool = True, **overrides: Any
) -> tuple[Path, Path]:
    """Save a tiny HF model (see make_tiny_hf_model) and its GGUF twin; return (hf_dir, gguf_path).

    With `with_tokenizer` the GGUF also carries the tiny tokenizer and ChatML template.
    """
    import json

    from safetensors.torch import load_file

    hf_dir = make_tiny_hf_model(arch, tmp_path, seed=seed, with_tokenizer=False, **overrides)
    cfg = json.loads((hf_dir / "config.json").read_text())
    state = load_file(str(hf_dir / "model.safetensors"))
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    out = Path(tmp_path) / f"{arch}-tiny.gguf"
    return hf_dir, write_gguf(state, cfg, arch, out, qtype=qtype, with_tokenizer=with_tokenizer)
