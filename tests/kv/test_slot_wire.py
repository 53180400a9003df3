"""A hybrid request's state slot on the wire (engine/kv/slot_wire.py): layout, gather, scatter.

Real: the StatePool of a Qwen3.5-shaped config (transformers' own config class, as the engine
reads it), in float32 and bfloat16; the layout checks of transfer/header.py. No model weights.
"""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine.kv.slot_wire import gather_state, scatter_state, slot_nbytes, slot_state_layout
from kvmesh.engine.kv.state_wire import gather_entries
from kvmesh.engine.model.config import ModelConfig
from kvmesh.engine.model.recurrent_state import StatePool
from kvmesh.engine.transfer.header import KIND_STATE, kv_layout, validate_layout
from tests.support.tiny_hybrid import TINY_HYBRID


def _config(**overrides) -> ModelConfig:
    from transformers import Qwen3_5TextConfig

    return ModelConfig.from_hf_config(Qwen3_5TextConfig(**{**TINY_HYBRID, **overrides}).to_dict())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_slot_round_trips_through_its_wire_bytes(dtype):
    # conv_dim * (K-1) * L * 2 bytes is not a multiple of 4 here in bf16: the fp32 run after it
    # cannot be viewed in place and takes the copying path.
    cfg = _config(linear_conv_kernel_dim=2, linear_num_key_heads=1, linear_num_value_heads=3,
                  linear_key_head_dim=15, linear_value_head_dim=15)  # conv_dim 75: 450 bf16 bytes
    src = StatePool(cfg, 3, dtype, torch.device("cpu"), num_checkpoints=2)
    src.conv.copy_(torch.randn(src.conv.shape))
    src.ssm.copy_(torch.randn(src.ssm.shape))
    layout = slot_state_layout(kv_layout(b"m", "float32", 16, 1, 2, 32), src, cfg.linear_layers)
    validate_layout(layout)
    assert layout.kind == KIND_STATE
    assert dtype != torch.bfloat16 or src.conv[:, 0].numel() * 2 % 4
    assert layout.nbytes == slot_nbytes(src) == StatePool.bytes_per_slot(cfg, src.conv.element_size())
    assert [b.name for b in layout.state] == [f"{k}.{i}" for k in ("conv", "ssm") for i in cfg.linear_layers]
    flat = gather_state(src, 1)
    assert flat.dtype == torch.uint8 and flat.numel() == layout.nbytes
    dst = StatePool(cfg, 2, dtype, torch.device("cpu"))
    scatter_state(dst, 0, flat)
    assert torch.equal(dst.conv[:, 0], src.conv[:, 1]) and torch.equal(dst.ssm[:, 0], src.ssm[:, 1])
    assert not dst.conv[:, 1].any() and not dst.ssm[:, 1].any()  # the other slot untouched
    # A slot on the wire is byte for byte a checkpoint of it (the cache node's payload).
    src.ckpt_conv[:, 1].copy_(src.conv[:, 1])
    src.ckpt_ssm[:, 1].copy_(src.ssm[:, 1])
    assert bytes(gather_entries(src.ckpt_conv, src.ckpt_ssm, [1])[0]) == bytes(flat.numpy())


def test_a_payload_of_another_size_is_refused():
    cfg = _config()
    pool = StatePool(cfg, 1, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="flat bytes"):
        scatter_state(pool, 0, torch.zeros(slot_nbytes(pool) - 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="DeltaNet layer ids"):
        slot_state_layout(kv_layout(b"m", "float32", 16, 1, 2, 32), pool, cfg.linear_layers[:-1])
