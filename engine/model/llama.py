"""Llama-family decoder forward over a flat batch with paged KV.

Covers Llama 2/3 (incl. llama3 RoPE scaling), SmolLM2, Mistral, Qwen2 (QKV
bias) and Qwen3 (per-head q/k RMSNorm). Weights arrive under Hugging Face names
and are fused at load time (q|k|v and gate|up) so each layer runs four matmuls.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvmesh.engine.kernels.quant_rows import QuantRows
from kvmesh.engine.kernels.rope import build_cos_sin_cache
from kvmesh.engine.model.attention import AttentionBackend, AttnMetadata
from kvmesh.engine.model.config import ModelConfig
from kvmesh.engine.model.linear import LinearFactory, LinearFn

log = logging.getLogger(__name__)


class WeightsError(ValueError):
    """The checkpoint lacks a tensor the architecture needs, or has the wrong shape."""


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: LinearFn  # -> [T, (Hq + 2 Hkv) * D]
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: LinearFn
    post_norm: torch.Tensor
    gate_up: LinearFn  # -> [T, 2 * intermediate]
    down: LinearFn


class LlamaModel:
    """Stateless apart from weights: the KV cache is passed in on every call.

    forward() writes this step's K/V into the cache at meta.slot_mapping before
    attending, so a sequence's queries see their own keys.
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
        max_position: int,
        quantized: Mapping[str, QuantRows] | None = None,
    ) -> None:
        self.config = config
        self.backend = backend
        self.dtype = dtype
        self.device = device
        self.scale = config.head_dim ** -0.5

        def take(name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
            try:
                t = weights[name]
            except KeyError:
                raise WeightsError(f"checkpoint has no tensor {name!r}") from None
            if shape is not None and tuple(t.shape) != shape:
                raise WeightsError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
            return t.to(device=device, dtype=dtype).contiguous()

        c = config
        linear = LinearFactory(device, dtype)
        blocks = quantized or {}

        def quant(*names: str) -> QuantRows | None:
            """The named weights' blocks stacked as their matrices are (None unless all have them)."""
            parts = [blocks.get(n) for n in names]
            return QuantRows.cat(parts) if all(p is not None for p in parts) else None  # type: ignore[arg-type]

        qd, kvd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.embed = take("model.embed_tokens.weight", (c.vocab_size, c.hidden_size))
        self.norm = take("model.norm.weight", (c.hidden_size,))
        if c.tie_word_embeddings or "lm_head.weight" not in weights:
            self.lm_head = linear(self.embed, quant=quant("model.embed_tokens.weight"))
        else:
            self.lm_head = linear(take("lm_head.weight", (c.vocab_size, c.hidden_size)), quant=quant("lm_head.weight"))
        self.layers: list[LayerWeights] = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            qkv = torch.cat([
                take(p + "self_attn.q_proj.weight", (qd, c.hidden_size)),
                take(p + "self_attn.k_proj.weight", (kvd, c.hidden_size)),
                take(p + "self_attn.v_proj.weight", (kvd, c.hidden_size)),
            ])
            bias = None
            if c.attention_bias:
                bias = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
            self.layers.append(LayerWeights(
                input_norm=take(p + "input_layernorm.weight", (c.hidden_size,)),
                qkv=linear(qkv, bias, quant(*(p + f"self_attn.{n}_proj.weight" for n in "qkv"))),
                q_norm=take(p + "self_attn.q_norm.weight", (c.head_dim,)) if c.qk_norm else None,
                k_norm=take(p + "self_attn.k_norm.weight", (c.head_dim,)) if c.qk_norm else None,
                o=linear(take(p + "self_attn.o_proj.weight", (c.hidden_size, qd)),
                         quant=quant(p + "self_attn.o_proj.weight")),
                post_norm=take(p + "post_attention_layernorm.weight", (c.hidden_size,)),
                gate_up=linear(torch.cat([
                    take(p + "mlp.gate_proj.weight", (c.intermediate_size, c.hidden_size)),
                    take(p + "mlp.up_proj.weight", (c.intermediate_size, c.hidden_size)),
                ]), quant=quant(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")),
                down=linear(take(p + "mlp.down_proj.weight", (c.hidden_size, c.intermediate_size)),
                            quant=quant(p + "mlp.down_proj.weight")),
            ))
        self.cos_sin = build_cos_sin_cache(
            c.head_dim, max_position, c.rope_theta, c.rope_scaling, device=device
        )
        self.quantized_bytes = linear.quantized_bytes
        if linear.quantized_bytes:
            log.info("small batches multiply from the file's quantized blocks (%.0f MB beside the dense weights)",
                     linear.quantized_bytes / 1e6)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttnMetadata,
        kv_cache: torch.Tensor,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids [T] -> final hidden states [T, hidden] (normed), or [len(keep), hidden].

        kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim].
        keep: indices of the tokens whose hidden states are wanted (those that produce
        logits). Every token's K/V is still written in every layer, but after the last
        layer's attention only these rows go through its output projection and MLP.
        """
        c, be = self.config, self.backend
        hq, hkv = c.num_heads, c.num_kv_heads
        eps = c.rms_norm_eps
        h = F.embedding(input_ids, self.embed)
        residual: torch.Tensor | None = None
        for i, lw in enumerate(self.layers):
            if residual is None:
                residual = h
                x, _ = be.rms_norm(h, lw.input_norm, eps)
            else:
                x, residual = be.rms_norm(h, lw.input_norm, eps, residual)
            qkv = lw.qkv(x)
            k_cache, v_cache = kv_cache[i, 0], kv_cache[i, 1]
            qk_norm = None if lw.q_norm is None else (lw.q_norm, lw.k_norm, eps)
            o = be.qkv_attention(qkv, hq, hkv, meta, self.cos_sin, k_cache, v_cache, self.scale, qk_norm)
            if keep is not None and i == len(self.layers) - 1:
                o, residual = o[keep], residual[keep]
            h = lw.o(o)
            x, residual = be.rms_norm(h, lw.post_norm, eps, residual)
            h = lw.down(be.silu_mul(lw.gate_up(x)))
        out, _ = be.rms_norm(h, self.norm, eps, residual)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in the model dtype (the sampler upcasts)."""
        return self.lm_head(hidden)
