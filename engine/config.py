"""Engine configuration: one dataclass shared by the CLI, the server and tests.

Imported when the `kvmesh` parser is built (the fields declare `kvmesh serve`'s options), so
torch is imported only by the methods that need it.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import TYPE_CHECKING

from kvmesh.engine.dtype_choice import AUTO, DtypeChoice, canonical_dtype, resolve_dtype
from kvmesh.engine.util.cliargs import parse_size
from kvmesh.engine.util.setting import setting

# The option groups of `kvmesh serve --help` (the settings below declare their flags).
MODEL, KV, SERVER = "model", "KV cache and batching", "server"


class ConfigError(ValueError):
    """An engine setting is invalid or impossible on this machine."""


if TYPE_CHECKING:
    import torch

def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """A concrete dtype name (or alias) as a ``torch.dtype``; ``auto`` is resolved first
    (``EngineConfig.dtype_choice``)."""
    import torch

    if isinstance(name, torch.dtype):
        return name
    try:
        n = canonical_dtype(name)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if n == AUTO:
        raise ConfigError("dtype 'auto' names no dtype until it is resolved for a device (EngineConfig.dtype_choice)")
    return getattr(torch, n)


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
    it never needs another block. admission_reserve_tokens: a waiting request is admitted only
    while the pool keeps room for this many more tokens of every running request and of itself
    (0: while blocks last); ttft_slo_ms: waiting requests past this first-token target are
    admitted after those within it (0: first come, first served); both in engine/scheduler.py.
    admission_tpot_ms: while requests run, at most one is admitted per step, and none while the
    recent steps that carried decodes averaged this long or longer (0: off; engine/tpot_gate.py).
    """

    model: str = "default"  # the CLI's --model/--model-path/--config resolve to this (server/cli.py)
    dtype: str = setting("auto", "--dtype", group=MODEL,
                         help="auto, float32, bfloat16 or float16; auto picks what the device computes natively: "
                              "bfloat16 on CPUs with AVX512_BF16 or AMX-BF16 and on GPUs from sm_80, float32 on "
                              "other CPUs, float16 on older GPUs (default: %(default)s)")
    device: str = setting("auto", "--device", group=MODEL, help="auto, cpu or cuda[:N] (default: %(default)s)")
    block_size: int = setting(16, "--block-size", group=KV, type=int,
                              help="tokens per KV block (default: %(default)s)")
    kv_cache_bytes: int | None = setting(
        None, "--kv-cache-bytes", group=KV, type=parse_size, metavar="SIZE",
        help="KV memory budget, e.g. 2GiB (default: a fraction of free GPU memory; 2GiB on CPU)")
    kv_cache_memory_fraction: float = setting(
        0.85, "--kv-cache-memory-fraction", group=KV, type=float,
        help="share of free GPU memory for KV when --kv-cache-bytes is not given")
    num_kv_blocks: int | None = setting(None, "--num-kv-blocks", group=KV, type=int,
                                        help="exact KV block count (overrides the budget)")
    max_num_seqs: int = setting(128, "--max-num-seqs", group=KV, type=int,
                                help="most requests running at once (default: %(default)s)")
    max_num_batched_tokens: int = setting(2048, "--max-num-batched-tokens", group=KV, type=int,
                                          help="token budget of one engine step (default: %(default)s)")
    max_model_len: int | None = setting(None, "--max-model-len", group=MODEL, type=int,
                                        help="longest prompt + completion in tokens (default: the model's)")
    admission_reserve_tokens: int = setting(
        128, "--admission-reserve-tokens", group=KV, type=int, metavar="N",
        help="admit a new request only while the KV pool also keeps room for the next N tokens of every "
             "running request and of the new one (at most to each one's max_tokens), so that streams are "
             "not preempted and recomputed to make room for new ones (0: admit while blocks last) "
             "(default: %(default)s)")
    enable_prefix_caching: bool = setting(True, "--no-prefix-caching", group=KV, action="store_false",
                                          help="disable prefix caching")
    enable_chunked_prefill: bool = setting(True, "--no-chunked-prefill", group=KV, action="store_false",
                                           help="disable chunked prefill")
    tpot_slo_ms: float = setting(0.0, "--tpot-slo-ms", group=KV, type=float,
                                 help="pace prefill chunks so that streams decoding beside them keep their mean "
                                      "time per output token within this many ms where their slack allows "
                                      "(engine/prefill_pacer.py; 0: off, the default)")
    ttft_slo_ms: float = setting(0.0, "--ttft-slo-ms", group=KV, type=float,
                                 help="admit waiting requests that can still get their first token within this "
                                      "many ms of arrival before those already past it, so that under overload "
                                      "more requests meet the target and those past it wait longer "
                                      "(engine/scheduler.py; 0: first come, first served, the default)")
    admission_tpot_ms: float = setting(0.0, "--admission-tpot-ms", group=KV, type=float,
                                       help="while requests run, admit at most one new request per step, and none "
                                            "while the recent steps that carried decodes (a stream's time per "
                                            "output token) averaged this many ms or more; set it some way below "
                                            "the TPOT target, e.g. 75%% of it (engine/tpot_gate.py; 0: off, the default)")
    attention_backend: str = setting("auto", "--attention-backend", group=MODEL,
                                     choices=("auto", "torch", "triton"), help="attention kernels (default: %(default)s)")
    cuda_graphs: bool = True
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    cache_salt: str = ""
    num_threads: int | None = setting(None, "--num-threads", group=MODEL, type=int,
                                      help="CPU threads for the forward pass")
    seed: int = setting(0, "--seed", group=MODEL, type=int, help="engine seed for unseeded sampling")
    cpu_kv_bytes: int = setting(
        0, "--cpu-kv-bytes", group=KV, type=parse_size, metavar="SIZE",
        help="host KV tier, e.g. 8GiB: blocks evicted from the KV pool are kept in host memory and loaded "
             "back on a prefix hit (default: off)")
    cpu_state_bytes: int = setting(
        0, "--cpu-state-bytes", group=KV, type=parse_size, metavar="SIZE",
        help="hybrid models with --cpu-kv-bytes: host memory for recurrent-state checkpoints evicted from "
             "--state-checkpoint-bytes, a budget of its own (default: a quarter of --cpu-kv-bytes)")
    state_checkpoint_interval: int = setting(
        1024, "--state-checkpoint-interval", group=KV, type=int, metavar="TOKENS",
        help="hybrid models: also checkpoint the recurrent state every TOKENS tokens (a multiple of the block "
             "size; 0: only at the end of each prompt and each generation) (default: %(default)s)")
    state_checkpoint_bytes: int = setting(
        512 << 20, "--state-checkpoint-bytes", group=KV, type=parse_size, metavar="SIZE",
        help="hybrid models: memory for recurrent-state checkpoints, whose count bounds prefix hits; 0 turns "
             "checkpoints and so hybrid prefix caching off (default: 512MiB)")
    cache_node: str | None = None  # the CLI's --cache-node, checked in server/cli.py
    auth_token_file: str | None = None  # the CLI's --auth-token-file: the engine's calls to the cache node carry it
    cache_node_timeout: float = setting(
        5.0, "--cache-node-timeout", group=KV, type=float, metavar="SECONDS",
        help="bound on one cache-node transfer; past it the blocks are recomputed (default: %(default)s)")
    kv_transfer_timeout: float = setting(
        30.0, "--kv-transfer-timeout", group=SERVER, type=float, metavar="SECONDS",
        help="bound on one prefill->decode handoff: a reservation waiting for its KV or for its request, "
             "and held prefill blocks waiting for confirmation (default: %(default)s)")
    kv_transfer_reserve_tokens: int = setting(
        4096, "--kv-transfer-reserve-tokens", group=SERVER, type=int, metavar="N",
        help="decode role: blocks reserved for a transferred request cover its prompt and up to N of its "
             "max_tokens (0: all of them); within N it never needs another block (default: %(default)s)")

    def resolved_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dev = torch.device(self.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device 'cuda' requested but no CUDA device is available")
        return dev

    def dtype_choice(self) -> DtypeChoice:
        """The compute dtype on the resolved device and why (engine/dtype_choice.py)."""
        try:
            return resolve_dtype(self.dtype, self.resolved_device())
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype_choice().dtype)

    def validate(self) -> "EngineConfig":
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if not self.ttft_slo_ms >= 0:  # also refuses NaN
            raise ConfigError(f"ttft_slo_ms must be >= 0 (0: first come, first served), got {self.ttft_slo_ms}")
        if not self.admission_tpot_ms >= 0:  # also refuses NaN
            raise ConfigError(f"admission_tpot_ms must be >= 0 (0: no gate), got {self.admission_tpot_ms}")
        if not self.tpot_slo_ms >= 0:  # also refuses NaN
            raise ConfigError(f"tpot_slo_ms must be >= 0 (0: no pacing), got {self.tpot_slo_ms}")
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
        if self.state_checkpoint_interval < 0 or self.state_checkpoint_interval % self.block_size:
            raise ConfigError(f"state_checkpoint_interval must be 0 or a multiple of the block size "
                              f"({self.block_size}), got {self.state_checkpoint_interval}")
        if not isinstance(self.cpu_state_bytes, int) or self.cpu_state_bytes < 0:
            raise ConfigError(f"cpu_state_bytes must be a byte count >= 0, got {self.cpu_state_bytes!r}")
        if not isinstance(self.state_checkpoint_bytes, int) or self.state_checkpoint_bytes < 0:
            raise ConfigError(f"state_checkpoint_bytes must be a byte count >= 0, got {self.state_checkpoint_bytes!r}")
        if not isinstance(self.admission_reserve_tokens, int) or self.admission_reserve_tokens < 0:
            raise ConfigError(f"admission_reserve_tokens must be >= 0, got {self.admission_reserve_tokens!r}")
        if not isinstance(self.kv_transfer_reserve_tokens, int) or self.kv_transfer_reserve_tokens < 0:
            raise ConfigError(f"kv_transfer_reserve_tokens must be >= 0, got {self.kv_transfer_reserve_tokens!r}")
        if self.kv_transfer_timeout <= 0:
            raise ConfigError(f"kv_transfer_timeout must be > 0 seconds, got {self.kv_transfer_timeout}")
        try:
            canonical_dtype(self.dtype)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return self
