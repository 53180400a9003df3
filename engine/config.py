"""Engine configuration: one dataclass shared by the CLI, the server and tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch


class ConfigError(ValueError):
    """An engine setting is invalid or impossible on this machine."""


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown dtype {name!r}; use one of float32, bfloat16, float16") from None


@dataclass
class EngineConfig:
    """Settings of one engine.

    model: "default" (the embedded SmolLM2), a .gguf file or a safetensors directory.
    kv_cache_bytes: KV pool size; None means kv_cache_memory_fraction of free device
    memory on CUDA, and 2 GiB on CPU. attention_backend: "auto" (triton on CUDA,
    torch on CPU), "torch" or "triton". seed: seeds the sampling noise of requests
    without a seed of their own, so one engine given the same requests in the same
    order samples the same tokens (a request's own seed always wins).
    enable_chunked_prefill=False: a prompt must fit in max_num_batched_tokens
    (longer ones are rejected at add_request).
    cpu_kv_bytes: size of the host KV tier (blocks evicted from the KV pool are kept
    there and loaded back on a prefix hit); 0 turns it off. cache_node: HOST:PORT of a
    cache node's HTTP port (or a headless Service in front of cache nodes): write-through
    of computed blocks and reload on admission; cache_node_timeout bounds each transfer
    (past it the blocks are recomputed). kv_transfer_timeout: how long a prefill/decode
    handoff may take (a decode engine's reservation waiting for its blocks, and again for the
    router's claim; a prefill engine's held blocks waiting for confirmation) before its blocks
    are freed. kv_transfer_reserve_tokens: a decode engine reserves the blocks of the prompt
    plus max_tokens generated tokens, at most this many (0: all of max_tokens); a request within
    it never needs another block.
    """

    model: str = "default"
    dtype: str = "bfloat16"
    device: str = "auto"
    block_size: int = 16
    kv_cache_bytes: int | None = None
    kv_cache_memory_fraction: float = 0.85
    num_kv_blocks: int | None = None  # overrides the byte budget (tests)
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    attention_backend: str = "auto"
    cuda_graphs: bool = True
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    cache_salt: str = ""
    num_threads: int | None = None
    seed: int = 0
    cpu_kv_bytes: int = 0
    cache_node: str | None = None
    cache_node_timeout: float = 5.0
    kv_transfer_timeout: float = 30.0
    kv_transfer_reserve_tokens: int = 4096

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dev = torch.device(self.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device 'cuda' requested but no CUDA device is available")
        return dev

    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    def validate(self) -> "EngineConfig":
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ConfigError(f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ConfigError("kv_cache_bytes must be positive")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ConfigError("kv_cache_memory_fraction must be in (0, 1]")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError("num_kv_blocks must be >= 1")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.cpu_kv_bytes, int) or self.cpu_kv_bytes < 0:
            raise ConfigError(f"cpu_kv_bytes must be a byte count >= 0, got {self.cpu_kv_bytes!r}")
        if (self.cpu_kv_bytes or self.cache_node) and not self.enable_prefix_caching:
            raise ConfigError("a host KV tier or a cache node needs prefix caching; enable it")
        if self.cache_node_timeout <= 0:
            raise ConfigError(f"cache_node_timeout must be > 0 seconds, got {self.cache_node_timeout}")
        if not isinstance(self.kv_transfer_reserve_tokens, int) or self.kv_transfer_reserve_tokens < 0:
            raise ConfigError(f"kv_transfer_reserve_tokens must be >= 0, got {self.kv_transfer_reserve_tokens!r}")
        if self.kv_transfer_timeout <= 0:
            raise ConfigError(f"kv_transfer_timeout must be > 0 seconds, got {self.kv_transfer_timeout}")
        parse_dtype(self.dtype)
        return self
