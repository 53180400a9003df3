"""Load a Hugging Face model directory (config.json + *.safetensors shards) into HF-named tensors.

This module also owns the weight-naming contract every loader returns:
Hugging Face Llama-family names (`model.embed_tokens.weight`,
`model.layers.{i}.self_attn.q_proj.weight`, ..., `model.norm.weight`, and
`lm_head.weight` only when the output matrix is not tied to the embedding).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

from .config import ModelConfig, UnsupportedModelError


class ModelLoadError(RuntimeError):
    """A checkpoint could not be read; the message names the file and what is wrong with it."""


# Buffers some older checkpoints saved alongside the parameters; the model recomputes them.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def check_weight_shapes(config: ModelConfig, weights: Mapping[str, torch.Tensor], source: object) -> None:
    """Fail at load time, naming the tensor, when the weights disagree with the config.

    Checks every layer's projections and norms plus the embedding, final norm and
    (untied) head, so a truncated or mismatched checkpoint never reaches the forward.
    """
    c = config
    if c.is_hybrid:
        from .qwen3_5 import hybrid_weight_shapes

        _check_expected(hybrid_weight_shapes(c), weights, source, c)
        return
    q, kv, h, f = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size, c.intermediate_size
    expect: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    if not c.tie_word_embeddings:
        expect["lm_head.weight"] = (c.vocab_size, h)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        expect |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (f, h),
            p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
        }
        if c.attention_bias:
            expect |= {
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,),
            }
        if c.qk_norm:
            expect |= {p + "self_attn.q_norm.weight": (c.head_dim,), p + "self_attn.k_norm.weight": (c.head_dim,)}
    _check_expected(expect, weights, source, c)


def _check_expected(expect: Mapping[str, tuple[int, ...]], weights: Mapping[str, torch.Tensor], source: object,
                    c: ModelConfig) -> None:
    for key, shape in expect.items():
        if key not in weights:
            raise ModelLoadError(
                f"{source}: tensor {key} is missing (the config describes {c.num_layers} {c.arch} layers)"
            )
        if tuple(weights[key].shape) != shape:
            raise ModelLoadError(f"{source}: {key} has shape {tuple(weights[key].shape)}, the config implies {shape}")


def _shard_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {e}") from None
        files = [directory / name for name in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{directory}: shards listed in {index.name} are missing: {', '.join(missing)}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{directory} holds no *.safetensors weights (pytorch_model.bin is not supported)")
    return files


def weights_digest(directory: str | Path) -> str:
    """Fingerprint (see fingerprint.py) of the directory's weight shards: their safetensors
    headers (tensor names, dtypes, shapes, offsets), sizes and sampled bytes."""
    import struct

    from .fingerprint import fingerprint

    files = _shard_files(Path(directory))
    table = bytearray()
    for shard in files:
        with open(shard, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            table += f.read(min(n, 100 << 20))  # the format caps headers at 100 MB; trust no more
    return fingerprint(files, bytes(table))


def read_hf_config(directory: Path, name: str | None = None) -> ModelConfig:
    path = directory / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{directory} has no config.json; a Hugging Face model directory needs one")
    try:
        raw = json.loads(path.read_text())
    except ValueError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
    try:
        return ModelConfig.from_hf_config(raw, name=name or directory.name)
    except KeyError as e:
        raise ModelLoadError(f"{path} lacks the field {e}") from None


def load_safetensors_dir(
    path: str | Path, dtype: torch.dtype = torch.float32, name: str | None = None
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read config.json and every weight shard of an HF directory; cast tensors to `dtype`.

    Invariant: the result holds HF names only; with tied embeddings there is no
    separate `lm_head.weight` (a checkpoint's duplicate copy is dropped).
    """
    from safetensors import SafetensorError, safe_open

    directory = Path(path)
    if not directory.is_dir():
        raise ModelLoadError(f"{directory} is not a directory")
    config = read_hf_config(directory, name)
    weights: dict[str, torch.Tensor] = {}
    for shard in _shard_files(directory):
        try:
            with safe_open(str(shard), framework="pt") as f:
                for key in f.keys():
                    if key.endswith(_IGNORED_SUFFIXES):
                        continue
                    # Cast one tensor at a time so peak memory stays near one copy of the model.
                    weights[key] = f.get_tensor(key).to(dtype)
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"could not read {shard}: {e}") from None
    # Hybrid checkpoints may carry a multi-token-prediction head kvmesh does not run.
    weights = {k: v for k, v in weights.items() if not k.startswith("mtp.")} if config.is_hybrid else weights
    # A bare LlamaModel checkpoint (no causal-LM head wrapper) stores names without "model.".
    if not any(k.startswith("model.") for k in weights):
        weights = {(k if k == "lm_head.weight" else f"model.{k}"): v for k, v in weights.items()}
    if config.tie_word_embeddings:
        head = weights.pop("lm_head.weight", None)
        if "model.embed_tokens.weight" not in weights and head is not None:
            weights["model.embed_tokens.weight"] = head
    check_weight_shapes(config, weights, directory)
    return config, weights


__all__ = ["ModelLoadError", "UnsupportedModelError", "check_weight_shapes", "load_safetensors_dir", "read_hf_config",
           "weights_digest"]
