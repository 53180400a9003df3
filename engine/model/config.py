"""Model architecture description shared by loaders, the model and the KV cache."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class UnsupportedModelError(ValueError):
    """The checkpoint describes an architecture kvmesh cannot run."""


SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "qwen3_5_text")
HYBRID_ARCHS = ("qwen3_5_text",)
FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"


@dataclass(frozen=True)
class LinearAttnSpec:
    """Geometry of a gated DeltaNet (linear-attention) layer, as Qwen3.5 has it.

    Each layer keeps, per request, a conv state ``[conv_dim, conv_kernel - 1]`` (the last
    inputs of its short causal conv) and a recurrent state ``[num_v_heads, k_head_dim,
    v_head_dim]``. Invariant: num_v_heads % num_k_heads == 0 (each q/k head serves
    num_v_heads // num_k_heads consecutive value heads).
    """

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int

    def __post_init__(self) -> None:
        if self.num_v_heads % self.num_k_heads:
            raise UnsupportedModelError(
                f"linear_num_value_heads={self.num_v_heads} is not a multiple of "
                f"linear_num_key_heads={self.num_k_heads}; kvmesh's gated DeltaNet needs whole groups"
            )
        if self.conv_kernel < 2:
            raise UnsupportedModelError(f"linear_conv_kernel_dim={self.conv_kernel}: kvmesh needs a kernel of at least 2")

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the short causal conv: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class ModelConfig:
    """Llama-family decoder geometry.

    Invariants: num_heads % num_kv_heads == 0; head_dim * num_heads need not
    equal hidden_size (Qwen3 decouples them).
    """

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before RoPE
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    name: str = "model"
    # Hybrid models (arch in HYBRID_ARCHS): one entry per layer, FULL_ATTENTION or
    # LINEAR_ATTENTION; empty for attention-only models. Only attention layers have KV.
    layer_types: tuple[str, ...] = ()
    linear: LinearAttnSpec | None = None
    partial_rotary_factor: float = 1.0  # RoPE rotates the first head_dim * factor dims only

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise UnsupportedModelError(
                f"architecture {self.arch!r} is not supported; kvmesh runs {', '.join(SUPPORTED_ARCHS)}"
            )
        if self.arch in HYBRID_ARCHS:
            _check_hybrid(self)
        elif self.layer_types and set(self.layer_types) != {FULL_ATTENTION}:
            raise UnsupportedModelError(
                f"{self.arch} layers must all be {FULL_ATTENTION!r}; got {sorted(set(self.layer_types))}"
            )
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def is_hybrid(self) -> bool:
        """Some layers keep recurrent state instead of KV (it cannot be rebuilt from KV)."""
        return self.linear is not None

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Indices of the layers with KV, in order; KV cache layer j belongs to layer attention_layers[j]."""
        if not self.layer_types:
            return tuple(range(self.num_layers))
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """Indices of the gated DeltaNet layers; state slot layer j belongs to layer linear_layers[j]."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def num_kv_layers(self) -> int:
        return len(self.attention_layers)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V one token occupies across all attention layers."""
        return self.num_kv_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str = "model") -> "ModelConfig":
        """Build from a Hugging Face config.json dict."""
        model_type = cfg.get("model_type", "llama")
        if model_type == "qwen3_5" and isinstance(cfg.get("text_config"), dict):
            raise UnsupportedModelError(
                "model_type 'qwen3_5' (the vision-language wrapper) is not supported; kvmesh runs its text "
                "architecture, model_type 'qwen3_5_text' (Qwen3_5ForCausalLM)"
            )
        if model_type not in SUPPORTED_ARCHS:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; kvmesh runs {', '.join(SUPPORTED_ARCHS)}"
            )
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        partial_rotary = cfg.get("partial_rotary_factor")
        # transformers >= 5 nests theta and scaling under rope_parameters.
        rp = cfg.get("rope_parameters")
        if isinstance(rp, dict):
            rope_theta = rope_theta or rp.get("rope_theta")
            partial_rotary = partial_rotary or rp.get("partial_rotary_factor")
            if rp.get("rope_type", "default") != "default" and not rope_scaling:
                # Multimodal RoPE sections only matter for image/video positions; text positions
                # are equal in all sections, which makes M-RoPE the plain rotation.
                rope_scaling = {k: v for k, v in rp.items()
                                if k not in ("rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved")}
        if rope_scaling:
            # Older configs spell the kind "type"; consumers read "rope_type" only.
            rope_scaling = {k: v for k, v in rope_scaling.items() if k != "type"} | {
                "rope_type": rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            }
            if rope_scaling["rope_type"] == "default":
                rope_scaling = None
        hybrid = _hybrid_fields(cfg, int(cfg["num_hidden_layers"])) if model_type in HYBRID_ARCHS else {}
        if model_type not in HYBRID_ARCHS and partial_rotary not in (None, 1, 1.0):
            raise UnsupportedModelError(f"partial_rotary_factor={partial_rotary} is not supported for {model_type}")
        return cls(
            arch=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=dict(rope_scaling) if rope_scaling else None,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type in ("qwen3", "qwen3_5_text"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
            partial_rotary_factor=float(partial_rotary or 1.0) if hybrid else 1.0,
            **hybrid,
        )


def _hybrid_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """layer_types and the DeltaNet geometry of a Qwen3.5 text config (KeyError names a missing field)."""
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval", 4))
        types = [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(num_layers)]
    return dict(
        layer_types=tuple(str(t) for t in types),
        linear=LinearAttnSpec(
            num_k_heads=int(cfg["linear_num_key_heads"]),
            num_v_heads=int(cfg["linear_num_value_heads"]),
            k_head_dim=int(cfg["linear_key_head_dim"]),
            v_head_dim=int(cfg["linear_value_head_dim"]),
            conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
        ),
    )


def _check_hybrid(c: ModelConfig) -> None:
    """A hybrid config kvmesh can run: every layer typed, only the two layer kinds it implements,
    at least one of each, and a rotary dimension RoPE can use."""
    if c.linear is None:
        raise UnsupportedModelError(f"{c.arch} needs the linear-attention geometry (linear_num_key_heads, ...)")
    if len(c.layer_types) != c.num_layers:
        raise UnsupportedModelError(
            f"layer_types lists {len(c.layer_types)} layers but num_hidden_layers is {c.num_layers}"
        )
    unknown = sorted(set(c.layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION})
    if unknown:
        raise UnsupportedModelError(
            f"layer types {unknown} are not supported in {c.arch}; kvmesh runs {FULL_ATTENTION!r} "
            f"and {LINEAR_ATTENTION!r} (gated DeltaNet) layers"
        )
    if FULL_ATTENTION not in c.layer_types:
        raise UnsupportedModelError(f"{c.arch} without any {FULL_ATTENTION!r} layer is not supported")
    rd = c.rotary_dim
    if rd <= 0 or rd % 2 or rd > c.head_dim:
        raise UnsupportedModelError(
            f"partial_rotary_factor={c.partial_rotary_factor} gives a rotary dimension of {rd} for head_dim "
            f"{c.head_dim}; it must be even and in (0, head_dim]"
        )
