"""Qwen3.5 text decoder (``Qwen3_5ForCausalLM``): gated DeltaNet layers and gated attention
layers (3:1 in the released models) over a flat batch, paged KV for the attention layers and
slot-held recurrent state for the others.

What differs from the Llama family, all checked against transformers' modeling_qwen3_5:
- every RMSNorm except the DeltaNet's output norm is zero-centred (``x * (1 + w)``): the
  weights are stored as ``1 + w`` at load, so the shared RMSNorm kernels apply;
- attention: q_proj emits ``[q_h | gate_h]`` per head; the output is multiplied by
  ``sigmoid(gate)`` before o_proj; q and k get per-head RMSNorm; RoPE rotates only the first
  ``head_dim * partial_rotary_factor`` dims (M-RoPE reduces to that for text positions);
- DeltaNet layers (deltanet.py) keep a conv and a recurrent state per request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvmesh.engine.kernels.gated_delta import GatedDeltaKernels, gated_delta_kernels
from kvmesh.engine.kernels.rope import build_cos_sin_cache, write_kv_ref
from kvmesh.engine.model.attention import AttentionBackend, AttnMetadata
from kvmesh.engine.model.config import FULL_ATTENTION, ModelConfig
from kvmesh.engine.model.deltanet import DeltaNetWeights, deltanet_mix
from kvmesh.engine.model.linear import LinearFactory, LinearFn
from kvmesh.engine.model.llama import WeightsError
from kvmesh.engine.model.recurrent_state import StateBatch


@dataclass
class GatedAttnWeights:
    q_gate: LinearFn  # -> [T, Hq * 2 * D], per head [q | gate]
    kv: LinearFn  # -> [T, 2 * Hkv * D]
    q_norm: torch.Tensor  # 1 + w
    k_norm: torch.Tensor  # 1 + w
    o: LinearFn


@dataclass
class HybridLayer:
    input_norm: torch.Tensor  # 1 + w
    post_norm: torch.Tensor  # 1 + w
    gate_up: LinearFn
    down: LinearFn
    attn: GatedAttnWeights | None = None  # exactly one of attn / deltanet
    deltanet: DeltaNetWeights | None = None
    index: int = 0  # KV cache layer (attention) or state layer (DeltaNet)


def hybrid_weight_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Qwen3.5 text checkpoint must hold, with its shape (HF names)."""
    lin = c.linear
    assert lin is not None
    h, f = c.hidden_size, c.intermediate_size
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = (c.vocab_size, h)
    for i, kind in enumerate(c.layer_types):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f)}
        if kind == FULL_ATTENTION:
            a = p + "self_attn."
            out |= {a + "q_proj.weight": (2 * q, h), a + "k_proj.weight": (kv, h), a + "v_proj.weight": (kv, h),
                    a + "o_proj.weight": (h, q), a + "q_norm.weight": (c.head_dim,), a + "k_norm.weight": (c.head_dim,)}
            if c.attention_bias:
                out |= {a + "q_proj.bias": (2 * q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,),
                        a + "o_proj.bias": (h,)}
        else:
            d = p + "linear_attn."
            out |= {d + "in_proj_qkv.weight": (lin.conv_dim, h), d + "in_proj_z.weight": (lin.value_dim, h),
                    d + "in_proj_b.weight": (lin.num_v_heads, h), d + "in_proj_a.weight": (lin.num_v_heads, h),
                    d + "conv1d.weight": (lin.conv_dim, 1, lin.conv_kernel), d + "A_log": (lin.num_v_heads,),
                    d + "dt_bias": (lin.num_v_heads,), d + "norm.weight": (lin.v_head_dim,),
                    d + "out_proj.weight": (h, lin.value_dim)}
    return out


class Qwen35Model:
    """Stateless apart from weights: the KV cache and the state pool are passed in on every call.

    forward() writes this step's K/V before attending (as LlamaModel does) and leaves each
    sequence's final DeltaNet state in its slot.
    """

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], backend: AttentionBackend,
                 dtype: torch.dtype, device: torch.device, max_position: int,
                 kernels: GatedDeltaKernels | None = None) -> None:
        if not config.is_hybrid:
            raise ValueError(f"{config.arch} is not a hybrid model; use LlamaModel")
        self.config = c = config
        self.backend = backend
        self.dtype = dtype
        self.device = device
        self.kernels = kernels or gated_delta_kernels(backend.name)  # the scan follows the attention backend
        self.scale = c.head_dim ** -0.5
        shapes = hybrid_weight_shapes(c)

        def take(name: str, fp32: bool = False) -> torch.Tensor:
            try:
                t = weights[name]
            except KeyError:
                raise WeightsError(f"checkpoint has no tensor {name!r}") from None
            if name in shapes and tuple(t.shape) != shapes[name]:
                raise WeightsError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {shapes[name]}")
            return t.to(device=device, dtype=torch.float32 if fp32 else dtype).contiguous()

        def centred(name: str) -> torch.Tensor:
            # transformers computes x_normed * (1 + w) in fp32; 1 + w is formed in fp32 here too.
            return (1.0 + take(name, fp32=True)).to(dtype)

        def bias(name: str) -> torch.Tensor | None:
            return take(name) if c.attention_bias else None

        linear = LinearFactory(device, dtype)
        self.embed = take("model.embed_tokens.weight")
        self.norm = centred("model.norm.weight")
        if c.tie_word_embeddings or "lm_head.weight" not in weights:
            self.lm_head = linear(self.embed)
        else:
            self.lm_head = linear(take("lm_head.weight"))
        self.layers: list[HybridLayer] = []
        n_attn = n_lin = 0
        for i, kind in enumerate(c.layer_types):
            p = f"model.layers.{i}."
            layer = HybridLayer(
                input_norm=centred(p + "input_layernorm.weight"),
                post_norm=centred(p + "post_attention_layernorm.weight"),
                gate_up=linear(torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])),
                down=linear(take(p + "mlp.down_proj.weight")),
            )
            if kind == FULL_ATTENTION:
                a = p + "self_attn."
                kv_bias = None
                if c.attention_bias:
                    kv_bias = torch.cat([take(a + "k_proj.bias"), take(a + "v_proj.bias")])
                layer.attn = GatedAttnWeights(
                    q_gate=linear(take(a + "q_proj.weight"), bias(a + "q_proj.bias")),
                    kv=linear(torch.cat([take(a + "k_proj.weight"), take(a + "v_proj.weight")]), kv_bias),
                    q_norm=centred(a + "q_norm.weight"), k_norm=centred(a + "k_norm.weight"),
                    o=linear(take(a + "o_proj.weight"), bias(a + "o_proj.bias")),
                )
                layer.index, n_attn = n_attn, n_attn + 1
            else:
                d = p + "linear_attn."
                layer.deltanet = DeltaNetWeights(
                    in_qkv=linear(take(d + "in_proj_qkv.weight")),
                    in_z=linear(take(d + "in_proj_z.weight")),
                    in_ba=linear(torch.cat([take(d + "in_proj_b.weight"), take(d + "in_proj_a.weight")])),
                    conv=take(d + "conv1d.weight").squeeze(1).contiguous(),
                    neg_a=-take(d + "A_log", fp32=True).exp(),
                    dt_bias=take(d + "dt_bias", fp32=True),
                    norm=take(d + "norm.weight"),
                    out=linear(take(d + "out_proj.weight")),
                )
                layer.index, n_lin = n_lin, n_lin + 1
            self.layers.append(layer)
        self.cos_sin = build_cos_sin_cache(c.rotary_dim, max_position, c.rope_theta, c.rope_scaling, device=device)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate the first rotary_dim dims of x [T, H, D] (HF's rotate_half layout), pass the rest."""
        rd = self.config.rotary_dim
        half = rd // 2
        table = self.cos_sin[positions]
        cos = table[:, :half].repeat(1, 2).to(x.dtype).unsqueeze(1)
        sin = table[:, half:].repeat(1, 2).to(x.dtype).unsqueeze(1)
        xr = x[..., :rd]
        rotated = torch.cat((-xr[..., half:], xr[..., :half]), dim=-1)
        return torch.cat((xr * cos + rotated * sin, x[..., rd:]), dim=-1)

    def _attention(self, x: torch.Tensor, w: GatedAttnWeights, meta: AttnMetadata, k_cache: torch.Tensor,
                   v_cache: torch.Tensor) -> torch.Tensor:
        c, be = self.config, self.backend
        t, d = x.shape[0], c.head_dim
        qg = w.q_gate(x).view(t, c.num_heads, 2 * d)
        q, gate = qg[..., :d], qg[..., d:].reshape(t, c.num_heads * d)
        kv = w.kv(x)
        k = kv[:, :c.num_kv_heads * d].reshape(t, c.num_kv_heads, d)
        v = kv[:, c.num_kv_heads * d:].reshape(t, c.num_kv_heads, d)
        q, _ = be.rms_norm(q.contiguous(), w.q_norm, c.rms_norm_eps)
        k, _ = be.rms_norm(k, w.k_norm, c.rms_norm_eps)
        q, k = self._rope(q, meta.positions), self._rope(k, meta.positions)
        write_kv_ref(k, v, k_cache, v_cache, meta.slot_mapping)
        o = be.attention(q.contiguous(), k_cache, v_cache, meta, self.scale).reshape(t, c.num_heads * d)
        return w.o(o * torch.sigmoid(gate))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttnMetadata, kv_cache: torch.Tensor,
                keep: torch.Tensor | None = None, state: StateBatch | None = None) -> torch.Tensor:
        """input_ids [T] -> final hidden states [T, hidden] (normed), or [len(keep), hidden].

        kv_cache: [num_attention_layers, 2, num_blocks, block_size, num_kv_heads, head_dim].
        state: the sequences' slots (required). ``keep`` trims rows after the last layer's mixer,
        as in LlamaModel; every layer still runs on every token, so every state advances.
        """
        if state is None:
            raise ValueError("a hybrid model's forward needs the sequences' state slots (StateBatch)")
        c, be = self.config, self.backend
        eps = c.rms_norm_eps
        h = F.embedding(input_ids, self.embed)
        residual: torch.Tensor | None = None
        for i, lw in enumerate(self.layers):
            if residual is None:
                residual = h
                x, _ = be.rms_norm(h, lw.input_norm, eps)
            else:
                x, residual = be.rms_norm(h, lw.input_norm, eps, residual)
            if lw.attn is not None:
                h = self._attention(x, lw.attn, meta, kv_cache[lw.index, 0], kv_cache[lw.index, 1])
            else:
                assert lw.deltanet is not None and c.linear is not None
                h = deltanet_mix(x, lw.deltanet, c.linear, lw.index, state, self.kernels, eps)
            if keep is not None and i == len(self.layers) - 1:
                h, residual = h[keep], residual[keep]
            x, residual = be.rms_norm(h, lw.post_norm, eps, residual)
            h = lw.down(be.silu_mul(lw.gate_up(x)))
        out, _ = be.rms_norm(h, self.norm, eps, residual)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
