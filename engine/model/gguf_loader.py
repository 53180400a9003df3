"""Load a Llama-family GGUF file into a ModelConfig and Hugging Face-named float tensors.

Quantized tensors are dequantized once at load time (one vectorized
`gguf.quants.dequantize` call per tensor); the engine runs in float/bf16.

Two conventions differ between GGUF and Hugging Face checkpoints and are undone here:
- GGUF lists dimensions fastest-first; the reader's numpy views are already in
  row-major (HF) order, so `[out_features, in_features]` comes out as HF has it.
- llama.cpp's converter permutes the rows of Q and K for `llama` GGUFs so that
  its rotary kernel can rotate adjacent pairs; HF rotates the two halves of each
  head. `unpermute_qk` inverts that permutation (qwen2/qwen3 GGUFs are not permuted).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvmesh.engine.kernels.quant_rows import QuantRows

from .config import ModelConfig, UnsupportedModelError
from .safetensors_loader import ModelLoadError, check_weight_shapes

# GGUF architecture name -> ModelConfig.arch
_GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}

_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def hf_name(gguf_name: str) -> str:
    """Map a GGUF tensor name to its Hugging Face Llama-family name.

    Raises UnsupportedModelError for tensors kvmesh has no place for (MoE experts, ...).
    """
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    if gguf_name == "rope_freqs.weight":
        raise UnsupportedModelError(
            "this GGUF stores precomputed rope frequency factors (llama3-style rope scaling), whose "
            "parameters GGUF does not record; load the model's safetensors directory instead"
        )
    raise UnsupportedModelError(
        f"GGUF tensor {gguf_name!r} has no Llama-family equivalent; kvmesh cannot run this model"
    )


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Invert llama.cpp's rotary row permutation of a Q or K weight (or bias).

    llama.cpp turns each head's rows [half0 | half1] into interleaved pairs
    (view as [n_head, 2, d/2] then swap the last two axes); the inverse views
    the rows as [n_head, d/2, 2] and swaps them back.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ModelLoadError(f"cannot unpermute a Q/K tensor with {rows} rows into {n_head} heads")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def slugify(text: str) -> str:
    """Lowercase, runs of anything but [a-z0-9.] become '-', no leading/trailing '-'."""
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")


def _rope_scaling(meta: Mapping[str, Any], arch: str) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise UnsupportedModelError(f"GGUF rope scaling type {kind!r} is not supported (linear and yarn are)")
    out: dict[str, Any] = {"rope_type": kind, "factor": float(meta.get(f"{arch}.rope.scaling.factor", 1.0))}
    orig = meta.get(f"{arch}.rope.scaling.original_context_length")
    if orig is not None:
        out["original_max_position_embeddings"] = int(orig)
    attn = meta.get(f"{arch}.rope.scaling.attn_factor")
    if attn is not None:
        out["attention_factor"] = float(attn)
    return out


def config_from_gguf_metadata(
    meta: Mapping[str, Any], tensor_names: Iterable[str], embed_rows: int, name: str
) -> ModelConfig:
    """Build a ModelConfig from GGUF key/value metadata (a pure function of its inputs).

    `tensor_names` are GGUF names (to detect untied output, biases, q/k norms);
    `embed_rows` is the vocabulary dimension of `token_embd.weight`.
    """
    gguf_arch = meta.get("general.architecture")
    if gguf_arch not in _GGUF_ARCHS:
        raise UnsupportedModelError(
            f"GGUF architecture {gguf_arch!r} is not supported; kvmesh runs {', '.join(_GGUF_ARCHS)}"
        )
    arch = _GGUF_ARCHS[gguf_arch]
    # llama.cpp files Mistral checkpoints under the llama architecture (same forward).
    if arch == "llama" and "mistral" in str(meta.get("general.name", "")).lower():
        arch = "mistral"
    names = set(tensor_names)
    p = gguf_arch

    def req(key: str) -> Any:
        try:
            return meta[f"{p}.{key}"]
        except KeyError:
            raise ModelLoadError(f"GGUF metadata lacks {p}.{key}") from None

    hidden = int(req("embedding_length"))
    num_heads = int(req("attention.head_count"))
    kv = meta.get(f"{p}.attention.head_count_kv", num_heads)
    head_dim = meta.get(f"{p}.attention.key_length") or hidden // num_heads
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        arch=arch,
        vocab_size=int(embed_rows),
        hidden_size=hidden,
        intermediate_size=int(req("feed_forward_length")),
        num_layers=int(req("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(kv),
        head_dim=int(head_dim),
        rope_theta=_f32(meta.get(f"{p}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(meta, p),
        rms_norm_eps=_f32(meta.get(f"{p}.attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(meta.get(f"{p}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos)),
        name=name,
    )


def _f32(value: Any) -> float:
    """The shortest decimal that round-trips a float32 (GGUF stores 1e-5 as 9.99999974e-06)."""
    # numpy prints a float32 with the fewest digits that map back to the same float32.
    return float(str(np.float32(value)))


def read_metadata(reader: Any) -> dict[str, Any]:
    """Scalar and string metadata of an open GGUFReader (the large tokenizer arrays are skipped)."""
    from gguf import GGUFValueType

    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if not field.types or field.types[0] == GGUFValueType.ARRAY:
            continue
        out[key] = field.contents()
    return out


def _to_tensor(data: np.ndarray, qtype: Any, dtype: torch.dtype) -> torch.Tensor:
    from gguf.quants import dequantize

    arr = dequantize(data, qtype)
    if not arr.flags.writeable:  # an F32/F16 view into the read-only memory map
        arr = arr.copy()
    return torch.from_numpy(arr).to(dtype)


def load_gguf(
    path: str | Path, dtype: torch.dtype = torch.float32, name: str | None = None,
    quantized: dict[str, QuantRows] | None = None,
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read `path` and return (config, weights under HF Llama names, each cast to `dtype`).

    Invariant: `weights` equals what transformers loads from the same GGUF;
    `lm_head.weight` is present only when the file has an untied output matrix.
    `name` overrides the model name (default: slug of `general.name`, else the file stem).
    `quantized`, when given, receives the file's blocks of every Q4_1/Q8_0 weight under the
    same names, rows in the same order (kernels/quant_rows.py: they dequantize to the fp32
    weights).
    """
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as e:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {e}") from None
    meta = read_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{path} has no token_embd.weight tensor")
    embed_rows = int(tensors["token_embd.weight"].shape[-1])  # GGUF shape is fastest-dimension first
    model_name = name or slugify(str(meta.get("general.name", ""))) or path.stem
    config = config_from_gguf_metadata(meta, tensors, embed_rows, model_name)

    hf_names = {gname: hf_name(gname) for gname in tensors}  # reject unsupported files before any dequantizing
    permute = meta.get("general.architecture") == "llama"
    weights: dict[str, torch.Tensor] = {}
    for gname, t in tensors.items():
        key = hf_names[gname]
        w = _to_tensor(t.data, t.tensor_type, dtype)
        heads = None
        if permute and key.endswith(("q_proj.weight", "q_proj.bias")):
            heads = config.num_heads
        elif permute and key.endswith(("k_proj.weight", "k_proj.bias")):
            heads = config.num_kv_heads
        if heads is not None:
            w = unpermute_qk(w, heads)
        weights[key] = w.contiguous()
        q = QuantRows.from_gguf(t.data, t.tensor_type.name) if quantized is not None else None
        if q is not None and q.rows == w.shape[0] and w.dim() == 2 and q.cols == w.shape[1]:
            if heads is not None:  # the same row order as the dequantized weight
                q = q.take(unpermute_qk(torch.arange(q.rows), heads))
            quantized[key] = q  # type: ignore[index]
    check_weight_shapes(config, weights, path)
    return config, weights


def weights_digest(path: str | Path) -> str:
    """Fingerprint (see fingerprint.py) of a GGUF file: its tensor table (names, quantization
    types, shapes, offsets), size and sampled bytes. Two quantizations of one model differ."""
    from gguf import GGUFReader

    from .fingerprint import fingerprint

    reader = GGUFReader(path)
    table = "\n".join(f"{t.name} {int(t.tensor_type)} {list(map(int, t.shape))} {int(t.data_offset)}"
                      for t in reader.tensors)
    return fingerprint([Path(path)], table.encode())
