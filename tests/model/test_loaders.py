"""GGUF and safetensors loaders, the config they derive, and load_model's dispatch."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from kvmesh.engine.kernels.quant_rows import KIND_Q4_1, QuantRows
from kvmesh.engine.model.config import ModelConfig, UnsupportedModelError
from kvmesh.engine.model.gguf_loader import (
    config_from_gguf_metadata,
    hf_name,
    load_gguf,
    slugify,
    unpermute_qk,
)
from kvmesh.engine.model.loader import LoadedModel, ModelLoadError, load_model
from kvmesh.engine.model.safetensors_loader import load_safetensors_dir

from tests.support.tiny_models import llamacpp_permute, make_tiny_gguf, make_tiny_hf_model

LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _hf_state(directory) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "model.safetensors"))


# ---- pure pieces ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_head,head_dim,cols", [(9, 64, 5), (3, 64, 7), (4, 16, 1), (2, 8, 0)])
def test_unpermute_inverts_llamacpp_permutation(n_head, head_dim, cols):
    shape = (n_head * head_dim, cols) if cols else (n_head * head_dim,)
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    permuted = torch.from_numpy(llamacpp_permute(w, n_head))
    assert not torch.equal(permuted, torch.from_numpy(w))
    assert torch.equal(unpermute_qk(permuted, n_head), torch.from_numpy(w))


def test_unpermute_rejects_indivisible_rows():
    with pytest.raises(ModelLoadError, match="cannot unpermute"):
        unpermute_qk(torch.zeros(10, 4), 3)


def test_tensor_names_map_to_hf():
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("blk.12.attn_k.bias") == "model.layers.12.self_attn.k_proj.bias"
    assert hf_name("blk.3.attn_q_norm.weight") == "model.layers.3.self_attn.q_norm.weight"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    with pytest.raises(UnsupportedModelError, match="ffn_gate_exps"):
        hf_name("blk.0.ffn_gate_exps.weight")
    with pytest.raises(UnsupportedModelError, match="safetensors"):
        hf_name("rope_freqs.weight")


def _meta(arch: str = "llama", **extra) -> dict:
    m = {
        "general.architecture": arch, "general.name": "Demo 7B",
        f"{arch}.block_count": 4, f"{arch}.context_length": 32768, f"{arch}.embedding_length": 256,
        f"{arch}.feed_forward_length": 512, f"{arch}.attention.head_count": 8, f"{arch}.attention.head_count_kv": 2,
        f"{arch}.rope.freq_base": 1e6, f"{arch}.attention.layer_norm_rms_epsilon": 9.999999974752427e-07,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
    }
    return m | extra


def test_config_from_gguf_metadata():
    names = ["token_embd.weight", "output.weight", "blk.0.attn_q.weight"]
    c = config_from_gguf_metadata(_meta(**{"tokenizer.ggml.eot_token_id": 7}), names, 1000, "demo")
    assert c == ModelConfig(
        arch="llama", vocab_size=1000, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=8,
        num_kv_heads=2, head_dim=32, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=32768,
        tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2, 7), name="demo",
    )
    q3 = config_from_gguf_metadata(
        _meta("qwen3", **{"qwen3.attention.key_length": 128}),
        ["token_embd.weight", "blk.0.attn_q_norm.weight"],
        1000,
        "q",
    )
    assert (q3.arch, q3.head_dim, q3.qk_norm) == ("qwen3", 128, True)
    assert not q3.attention_bias and q3.tie_word_embeddings
    q2 = config_from_gguf_metadata(_meta("qwen2"), ["token_embd.weight", "blk.0.attn_q.bias"], 1000, "q")
    assert q2.attention_bias and not q2.qk_norm
    lin = config_from_gguf_metadata(
        _meta(**{"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}), names, 1000, "x"
    )
    assert lin.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    mistral = config_from_gguf_metadata(_meta(**{"general.name": "Mistral 7B Instruct"}), names, 1000, "x")
    assert mistral.arch == "mistral"
    with pytest.raises(UnsupportedModelError, match="'gemma2'"):
        config_from_gguf_metadata(_meta("gemma2"), names, 1000, "x")
    with pytest.raises(ModelLoadError, match="llama.block_count"):
        config_from_gguf_metadata({k: v for k, v in _meta().items() if k != "llama.block_count"}, names, 1000, "x")


def test_slugify():
    assert slugify("Smollm2 135M 8k Lc100K Mix1 Ep2") == "smollm2-135m-8k-lc100k-mix1-ep2"
    assert slugify("  Qwen2.5 / 0.5B_Instruct ") == "qwen2.5-0.5b-instruct"


# ---- GGUF files ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("qwen2", {}), ("qwen3", {"tie_word_embeddings": True})])
def test_tiny_gguf_roundtrips_exactly(tmp_path, arch, overrides):
    hf_dir, gguf_path = make_tiny_gguf(arch, tmp_path, **overrides)
    config, weights = load_gguf(gguf_path)
    ref_config, ref = load_safetensors_dir(hf_dir)
    assert config == ModelConfig(**{**ref_config.__dict__, "name": "tiny-test"})
    assert weights.keys() == ref.keys()
    for k in ref:
        assert torch.equal(weights[k], ref[k]), k


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_matches_transformers_gguf_loading(tmp_path, arch):
    """Independent check of naming and the Q/K un-permutation against transformers' own GGUF loader."""
    from transformers import AutoModelForCausalLM

    _, gguf_path = make_tiny_gguf(arch, tmp_path, qtype="Q8_0")
    _, weights = load_gguf(gguf_path, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).state_dict()
    assert weights.keys() == ref.keys()
    for k in ref:
        assert torch.equal(weights[k], ref[k]), k


def test_gguf_dtype_and_errors(tmp_path):
    _, gguf_path = make_tiny_gguf("llama", tmp_path, qtype="Q4_1")
    config, weights = load_gguf(gguf_path, dtype=torch.bfloat16, name="custom")
    assert config.name == "custom" and all(w.dtype == torch.bfloat16 for w in weights.values())
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_gguf(tmp_path / "nope.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        load_gguf(junk)


# ---- safetensors directories ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arch,overrides,expect",
    [
        ("llama", {"rope_scaling": LLAMA3_ROPE}, dict(rope_theta=500000.0, rope_scaling=LLAMA3_ROPE, head_dim=16)),
        ("llama", {"tie_word_embeddings": True}, dict(tie_word_embeddings=True, rope_scaling=None)),
        ("mistral", {}, dict(rope_theta=1e6, attention_bias=False, qk_norm=False)),
        ("qwen2", {}, dict(attention_bias=True, qk_norm=False)),
        ("qwen2", {"tie_word_embeddings": True}, dict(attention_bias=True, tie_word_embeddings=True)),
        ("qwen3", {}, dict(qk_norm=True, attention_bias=False, head_dim=32)),
    ],
)
def test_safetensors_dir_loads_every_tensor(tmp_path, arch, overrides, expect):
    d = make_tiny_hf_model(arch, tmp_path, **overrides)
    config, weights = load_safetensors_dir(d, dtype=torch.float32)
    base = dict(arch=arch, vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                num_kv_heads=2, rms_norm_eps=1e-5, max_position_embeddings=512, bos_token_id=1, eos_token_ids=(2,),
                tie_word_embeddings=False, name=d.name)
    for field, value in (base | expect).items():
        assert getattr(config, field) == value, field
    ref = _hf_state(d)
    if config.tie_word_embeddings:
        assert "lm_head.weight" not in weights
        ref.pop("lm_head.weight", None)
    assert weights.keys() == ref.keys()
    for k in ref:
        assert torch.equal(weights[k], ref[k]), k


def test_sharded_checkpoint_bf16_and_tied_duplicate_dropped(tmp_path):
    from transformers import AutoModelForCausalLM

    d = make_tiny_hf_model("qwen2", tmp_path, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_pretrained(str(d))
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 2
    # A checkpoint that stores the tied head anyway must not yield a second copy.
    extra = sharded / "head.safetensors"
    save_file({"lm_head.weight": model.state_dict()["model.embed_tokens.weight"].clone()}, str(extra))
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = extra.name
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    config, weights = load_safetensors_dir(sharded, dtype=torch.bfloat16)
    assert config.tie_word_embeddings and "lm_head.weight" not in weights
    ref = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert weights.keys() == ref.keys() and all(torch.equal(weights[k], ref[k]) for k in ref)


def test_legacy_config_fields(tmp_path):
    d = make_tiny_hf_model("llama", tmp_path, with_tokenizer=False)
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("rope_parameters")
    cfg |= {"rope_theta": 250000.0, "rope_scaling": {"type": "linear", "factor": 2.0}, "eos_token_id": [2, 5]}
    (d / "config.json").write_text(json.dumps(cfg))
    config, _ = load_safetensors_dir(d)
    assert config.rope_theta == 250000.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert config.eos_token_ids == (2, 5)


def test_safetensors_errors(tmp_path):
    d = make_tiny_hf_model("llama", tmp_path, with_tokenizer=False)
    (d / "model.safetensors").rename(tmp_path / "moved.safetensors")
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_safetensors_dir(d)
    state = load_file(str(tmp_path / "moved.safetensors"))
    state.pop("model.layers.1.mlp.up_proj.weight")
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="model.layers.1.mlp.up_proj.weight is missing"):
        load_safetensors_dir(d)
    (d / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_safetensors_dir(d)


# ---- load_model ----------------------------------------------------------------------------------------------------


def test_load_model_directory(tmp_path):
    d = make_tiny_hf_model("qwen3", tmp_path)
    m = load_model(str(d), dtype=torch.bfloat16)
    assert isinstance(m, LoadedModel) and m.source == str(d)
    assert m.config.arch == "qwen3" and m.weights["model.norm.weight"].dtype == torch.bfloat16
    assert m.tokenizer.eos_token_ids == (2,) and m.tokenizer.vocab_size == 1000
    assert m.tokenizer.decode(m.tokenizer.encode("Paris is the capital")) == "Paris is the capital"


def test_load_model_rejects_unknown_sources(tmp_path):
    with pytest.raises(ModelLoadError, match="tried the default model name.*no such file"):
        load_model(str(tmp_path / "missing"))
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not .gguf"):
        load_model(str(f))
    d = make_tiny_hf_model("llama", tmp_path, with_tokenizer=False)
    with pytest.raises(ModelLoadError, match="holds no tokenizer"):
        load_model(str(d))


# ---- the real default model ----------------------------------------------------------------------------------------


@pytest.mark.slow  # the default model in kvmesh and in transformers: about 30 s
def test_default_gguf_equals_transformers_and_notes():
    from transformers import AutoModelForCausalLM

    from kvmesh.engine.model.fetch import ensure_default_model

    path = ensure_default_model(progress=False)
    t0 = time.perf_counter()
    config, weights = load_gguf(path)
    ours = time.perf_counter() - t0
    assert (config.arch, config.num_layers, config.hidden_size, config.intermediate_size) == ("llama", 30, 576, 1536)
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size) == (9, 3, 64, 49152)
    assert (config.rope_theta, config.rms_norm_eps, config.max_position_embeddings) == (100000.0, 1e-5, 8192)
    assert config.tie_word_embeddings and config.rope_scaling is None
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))
    assert config.kv_bytes_per_token(2) == 23040

    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    theirs = time.perf_counter() - t0
    ref = hf.state_dict()
    assert set(ref) - set(weights) == {"lm_head.weight"}  # tied: HF lists the shared tensor twice
    assert set(weights) <= set(ref)
    for k, w in weights.items():
        assert torch.equal(w, ref[k]), k
    print(f"load_gguf {ours:.1f}s, transformers {theirs:.1f}s")


@pytest.mark.slow  # loads the default model: about 10 s
def test_load_model_default():
    from kvmesh.engine.model.fetch import DEFAULT_MODEL_NAME

    t0 = time.perf_counter()
    m = load_model("default", dtype=torch.bfloat16)
    elapsed = time.perf_counter() - t0
    assert m.config.name == DEFAULT_MODEL_NAME and m.source.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert m.weights["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert m.tokenizer.eos_token_ids == (2,) and m.tokenizer.vocab_size == 49152
    print(f"load_model('default') {elapsed:.1f}s")


def test_load_model_gguf_file(tmp_path):
    hf_dir, gguf_path = make_tiny_gguf("qwen2", tmp_path, qtype="Q8_0")
    m = load_model(str(gguf_path))
    assert m.source == str(gguf_path) and m.config.name == "tiny-test" and m.config.attention_bias
    assert m.tokenizer.eos_token_ids == (2,) and m.tokenizer.has_chat_template
    ref_config, _ = load_safetensors_dir(hf_dir)
    assert (m.config.num_layers, m.config.vocab_size) == (ref_config.num_layers, ref_config.vocab_size)


def _dense(q: QuantRows) -> torch.Tensor:
    """The blocks' matrix in torch (independent of the native kernel): Q4_1 d * q + m, Q8_0 q * d."""
    if q.kind == KIND_Q4_1:
        nib = torch.cat([q.qs & 0x0F, q.qs >> 4], dim=-1).float()  # element j, then j + 16
        return (q.scale[..., None] * nib + q.minv[..., None]).reshape(q.rows, q.cols)
    return (q.qs.view(torch.int8).float() * q.scale[..., None]).reshape(q.rows, q.cols)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_gguf_blocks_kept_beside_the_weights_in_their_row_order(tmp_path, qtype):
    _, gguf_path = make_tiny_gguf("llama", tmp_path, qtype=qtype)
    quantized: dict = {}
    _, weights = load_gguf(gguf_path, dtype=torch.float32, quantized=quantized)
    assert any(k.endswith("q_proj.weight") for k in quantized)  # the un-permuted rows are covered
    for k, q in quantized.items():
        assert torch.equal(_dense(q), weights[k]), k
    assert load_gguf(gguf_path, dtype=torch.float32)[1].keys() == weights.keys()  # not asked: nothing kept
