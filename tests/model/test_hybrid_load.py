"""Loading hybrid (Qwen3.5 text) checkpoints, and refusing the ones kvmesh cannot run.

Real: transformers writes the checkpoints (tiny random Qwen3_5ForCausalLM), kvmesh's
safetensors loader and ModelConfig read them; bad ones are edits of real config files.
"""

from __future__ import annotations

import json

import pytest
import torch

from kvmesh.engine.model.config import ModelConfig, UnsupportedModelError
from kvmesh.engine.model.loader import load_model
from kvmesh.engine.model.recurrent_state import StatePool
from kvmesh.engine.model.safetensors_loader import ModelLoadError
from tests.support.tiny_hybrid import make_tiny_hybrid_model


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return make_tiny_hybrid_model(tmp_path_factory.mktemp("hybrid"))


def _edited(hybrid_dir, tmp_path, **changes):
    cfg = json.loads((hybrid_dir / "config.json").read_text())
    cfg.update(changes)
    return ModelConfig.from_hf_config(cfg)


def test_qwen3_5_text_loads(hybrid_dir):
    """model_type 'qwen3_5_text' loads: layer kinds, DeltaNet geometry, partial RoPE, KV only for attention layers."""
    loaded = load_model(str(hybrid_dir), torch.float32)
    c = loaded.config
    assert c.arch == "qwen3_5_text" and c.is_hybrid
    assert c.attention_layers == (3,) and c.linear_layers == (0, 1, 2)
    assert c.rotary_dim == 8  # head_dim 32 * partial_rotary_factor 0.25
    assert c.kv_bytes_per_token(4) == 1 * 2 * 2 * 32 * 4
    # conv 128 channels x 3 taps (fp32) + 4 heads x 16 x 16 fp32, per DeltaNet layer, 3 layers
    assert StatePool.bytes_per_slot(c, 4) == 3 * (128 * 3 * 4 + 4 * 16 * 16 * 4)
    assert "model.layers.0.linear_attn.A_log" in loaded.weights


@pytest.mark.parametrize("changes, match", [
    (dict(layer_types=["linear_attention", "mamba", "linear_attention", "full_attention"]), r"\['mamba'\]"),
    (dict(layer_types=["linear_attention"] * 4), "without any 'full_attention'"),
    (dict(layer_types=["full_attention"] * 3), "lists 3 layers"),
    (dict(linear_num_value_heads=3), "linear_num_value_heads=3 is not a multiple"),
    (dict(linear_conv_kernel_dim=1), "linear_conv_kernel_dim=1"),
    (dict(rope_parameters={"rope_theta": 1e4, "rope_type": "default", "partial_rotary_factor": 0.3}),
     "rotary dimension"),
])
def test_unsupported_hybrids_fail_naming_what(hybrid_dir, tmp_path, changes, match):
    """Layer kinds and state shapes kvmesh does not implement fail at config time with a message naming them."""
    with pytest.raises(UnsupportedModelError, match=match):
        _edited(hybrid_dir, tmp_path, **changes)


def test_vision_language_wrapper_is_refused():
    """The multimodal qwen3_5 config is refused with a pointer to the text architecture."""
    with pytest.raises(UnsupportedModelError, match="qwen3_5_text"):
        ModelConfig.from_hf_config({"model_type": "qwen3_5", "text_config": {}})


def test_missing_deltanet_tensor_is_named(tmp_path):
    """A checkpoint missing a DeltaNet tensor fails at load naming it."""
    from safetensors.torch import load_file, save_file

    d = make_tiny_hybrid_model(tmp_path, with_tokenizer=False)
    state = load_file(str(d / "model.safetensors"))
    del state["model.layers.1.linear_attn.conv1d.weight"]
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="layers.1.linear_attn.conv1d.weight is missing"):
        load_model(str(d), torch.float32)
