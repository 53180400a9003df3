"""Model identity for block hashes comes from the weight files, not from names."""

from __future__ import annotations

import shutil

import torch

from kvmesh.engine.block_hash import extra_key
from kvmesh.engine.model.loader import load_model

from tests.support.tiny_models import make_tiny_gguf, make_tiny_hf_model


def _id(path) -> str:
    return load_model(str(path), torch.float32).model_id


def test_same_weights_same_identity_wherever_they_live(tmp_path):
    src = make_tiny_hf_model("llama", tmp_path / "a")
    copy = shutil.copytree(src, tmp_path / "b" / "elsewhere")
    a, b = _id(src), _id(copy)
    assert a.split("@")[1] == b.split("@")[1]


def test_two_directories_named_model_differ(tmp_path):
    one = make_tiny_hf_model("llama", tmp_path / "x", seed=1).rename(tmp_path / "x" / "model")
    two = make_tiny_hf_model("llama", tmp_path / "y", seed=2).rename(tmp_path / "y" / "model")
    a, b = _id(one), _id(two)
    assert a.split("@")[0] == b.split("@")[0] == "model"
    assert a != b
    assert extra_key(a, "float32") != extra_key(b, "float32")


def test_two_quantizations_of_one_gguf_differ(tmp_path):
    _, f32 = make_tiny_gguf("llama", tmp_path / "f", qtype="F32")
    _, q8 = make_tiny_gguf("llama", tmp_path / "q", qtype="Q8_0")
    a, b = load_model(str(f32), torch.float32), load_model(str(q8), torch.float32)
    assert a.config.name == b.config.name  # same general.name ...
    assert a.model_id != b.model_id  # ... but different weights
