"""`kvmesh serve`: one engine behind the OpenAI-compatible HTTP API.

This module is imported whenever the `kvmesh` parser is built, so it imports
nothing heavy at module level (torch, FastAPI and the engine load in the handler).
"""

from __future__ import annotations

import argparse
import logging
import sys

from kvmesh.engine.api.body_limit import DEFAULT_MAX_REQUEST_BYTES
from kvmesh.engine.util.cliargs import ArgsError, add_max_request_bytes, config_model_path, parse_size, port_or_zero

ROLES = ("both", "prefill", "decode")


def _kv_events_port(text: str) -> int:
    return port_or_zero(text, 65534, "a KV events port (the replay socket takes the next one)", "off")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model")
    m.add_argument("--model", default="default",
                   help="'default' (the embedded SmolLM2-135M-Instruct, fetched on first use), a .gguf file "
                        "or a Hugging Face safetensors directory (default: %(default)s)")
    m.add_argument("--model-path", default=None, metavar="PATH",
                   help="load the weights from this .gguf file or safetensors directory and serve them "
                        "under the name given by --model (how the operator passes a model on a volume)")
    m.add_argument("--model-format", choices=("gguf", "safetensors"), default=None,
                   help="check that --model-path holds this format")
    m.add_argument("--model-uri", default=None, metavar="URI",
                   help="remote model location (not supported yet: mount the model and use --model-path)")
    m.add_argument("--config", default=None, metavar="FILE",
                   help="YAML configuration written by the operator (kvmesh.yaml); its model.source.path "
                        "is used when --model-path is not given")
    m.add_argument("--served-model-name", action="append", default=None, metavar="NAME",
                   help="name(s) clients use in 'model' (repeatable; default: the model's own name)")
    m.add_argument("--dtype", default="bfloat16", help="float32, bfloat16 or float16 (default: %(default)s)")
    m.add_argument("--device", default="auto", help="auto, cpu or cuda[:N] (default: %(default)s)")
    m.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + completion in tokens (default: the model's)")
    m.add_argument("--attention-backend", default="auto", choices=("auto", "torch", "triton"))
    m.add_argument("--num-threads", type=int, default=None, help="CPU threads for the forward pass")
    m.add_argument("--seed", type=int, default=0, help="engine seed for unseeded sampling")

    k = p.add_argument_group("KV cache and batching")
    k.add_argument("--kv-cache-bytes", type=parse_size, default=None, metavar="SIZE",
                   help="KV memory budget, e.g. 2GiB (default: a fraction of free GPU memory; 2GiB on CPU)")
    k.add_argument("--kv-cache-memory-fraction", type=float, default=0.85,
                   help="share of free GPU memory for KV when --kv-cache-bytes is not given")
    k.add_argument("--num-kv-blocks", type=int, default=None, help="exact KV block count (overrides the budget)")
    k.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: %(default)s)")
    k.add_argument("--max-num-seqs", type=int, default=128,
                   help="most requests running at once (default: %(default)s)")
    k.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of one engine step (default: %(default)s)")
    k.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    k.add_argument("--cpu-kv-bytes", type=parse_size, default=0, metavar="SIZE",
                   help="host KV tier, e.g. 8GiB: blocks evicted from the KV pool are kept in host memory "
                        "and loaded back on a prefix hit (default: off)")
    k.add_argument("--cache-node", default=None, metavar="HOST:PORT",
                   help="a cache node's HTTP address (or a headless Service of cache nodes): computed blocks "
                        "are written through to it and reloaded from it instead of recomputed")
    k.add_argument("--cache-node-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="bound on one cache-node transfer; past it the blocks are recomputed (default: %(default)s)")
    k.add_argument("--no-chunked-prefill", action="store_true", help="disable chunked prefill")

    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in containers)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--role", choices=ROLES, default="both",
                   help="both: prefill and decode in this engine (default); prefill: compute prompts and hand "
                        "their KV and first token to a decode engine; decode: generate from KV it receives "
                        "(plain requests are served colocated). See docs/disagg.md")
    s.add_argument("--kv-transfer-port", type=port_or_zero, default=0, metavar="PORT",
                   help="decode role: UCX port that receives KV from prefill engines (0: any free port, "
                        "reported by /kv/info; the operator uses 8001)")
    s.add_argument("--kv-transfer-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="bound on one prefill->decode handoff: a reservation waiting for its KV or for its "
                        "request, and held prefill blocks waiting for confirmation (default: %(default)s)")
    s.add_argument("--kv-transfer-reserve-tokens", type=int, default=4096, metavar="N",
                   help="decode role: blocks reserved for a transferred request cover its prompt and up to N of "
                        "its max_tokens (0: all of them); within N it never needs another block "
                        "(default: %(default)s)")
    s.add_argument("--kv-transfer-overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="prefill role: push each prompt block to the decode engine as soon as its chunk is "
                        "computed, overlapping the transfer with later chunks (default: on)")
    s.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="sequences that may wait for their first token before new requests get 429 "
                        "(0: unbounded; default: %(default)s)")
    add_max_request_bytes(s, DEFAULT_MAX_REQUEST_BYTES)
    s.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, how long in-flight requests may run before they are aborted")
    s.add_argument("--cache-service", default=None, metavar="HOST:PORT",
                   help="the same as --cache-node (the name the operator renders: the cache nodes' headless "
                        "Service and HTTP port)")
    s.add_argument("--kv-events-port", type=_kv_events_port, default=0, metavar="PORT",
                   help="publish KV cache events (ZeroMQ PUB, vLLM's layout) on PORT and answer replay "
                        "requests on PORT+1; 0 turns them off (default: %(default)s; the operator uses 5557)")
    s.add_argument("--kv-events-host", default=None, metavar="ADDR",
                   help="address the KV event sockets bind (default: --host)")
    s.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    s.add_argument("--access-log", action="store_true", help="log every HTTP request")


def add_serve_subcommand(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve", help="serve a model over the OpenAI-compatible API",
        description="Run one engine behind an OpenAI-compatible HTTP API (/v1/completions, "
                    "/v1/chat/completions, /v1/models, /health, /ready, /metrics).")
    add_serve_arguments(p)
    p.set_defaults(func=handler)


class ServeArgsError(ArgsError):
    """The command line asks for something `kvmesh serve` cannot do; the message says what."""


def resolve_model(args: argparse.Namespace) -> tuple[str, list[str]]:
    """(what to load, names to serve it under) from --model/--model-path/--config/--model-uri."""
    import os

    names = list(args.served_model_name or [])
    if args.model_uri:
        raise ServeArgsError(f"--model-uri {args.model_uri} is not supported yet; mount the model on a "
                             "volume and pass --model-path")
    try:
        path = args.model_path or (config_model_path(args.config) if args.config else None)
    except ArgsError as e:
        raise ServeArgsError(str(e)) from None
    if path is None:
        return args.model, names
    if not os.path.exists(path):
        raise ServeArgsError(f"model path {path} does not exist")
    is_gguf = os.path.isfile(path) and path.endswith(".gguf")
    if args.model_format == "gguf" and not is_gguf:
        raise ServeArgsError(f"--model-format gguf but {path} is not a .gguf file")
    if args.model_format == "safetensors" and not os.path.isdir(path):
        raise ServeArgsError(f"--model-format safetensors but {path} is not a directory")
    return path, names or ([args.model] if args.model != "default" else [])


def _cache_node(args: argparse.Namespace) -> str | None:
    """--cache-node, or the operator's --cache-service (they name the same thing)."""
    node, service = args.cache_node, args.cache_service
    if node and service and node != service:
        raise ServeArgsError(f"--cache-node {node} and --cache-service {service} disagree; give one")
    address = node or service
    if address:
        from kvmesh.engine.kv.node_link import CacheNodeAddressError, parse_host_port

        try:
            parse_host_port(address)
        except CacheNodeAddressError as e:
            raise ServeArgsError(str(e)) from None
    return address


def settings_from_args(args: argparse.Namespace):  # -> ServeSettings (imported lazily)
    from kvmesh.engine.config import EngineConfig
    from kvmesh.engine.server.runtime import ServeSettings

    model, served_names = resolve_model(args)
    engine = EngineConfig(
        model=model, dtype=args.dtype, device=args.device, block_size=args.block_size,
        kv_cache_bytes=args.kv_cache_bytes, kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching, enable_chunked_prefill=not args.no_chunked_prefill,
        attention_backend=args.attention_backend, num_threads=args.num_threads, seed=args.seed,
        cpu_kv_bytes=args.cpu_kv_bytes, cache_node=_cache_node(args),
        cache_node_timeout=args.cache_node_timeout, kv_transfer_timeout=args.kv_transfer_timeout,
        kv_transfer_reserve_tokens=args.kv_transfer_reserve_tokens,
    )
    return ServeSettings(
        engine=engine, host=args.host, port=args.port, served_model_names=served_names,
        max_waiting_requests=args.max_waiting_requests, drain_timeout_s=args.drain_timeout,
        max_request_bytes=args.max_request_bytes,
        log_level=args.log_level, access_log=args.access_log,
        kv_events_port=args.kv_events_port, kv_events_host=args.kv_events_host or args.host,
        role=args.role, kv_transfer_port=args.kv_transfer_port, kv_transfer_overlap=args.kv_transfer_overlap,
    )


def handler(args: argparse.Namespace) -> int:
    """Entry point of `kvmesh serve`; returns the exit code (0 after a drained shutdown)."""
    from kvmesh.engine.config import ConfigError

    try:
        settings = settings_from_args(args)
    except ServeArgsError as e:
        print(f"kvmesh serve: {e}", file=sys.stderr)
        return 2
    try:
        settings.engine.validate()
        settings.engine.resolved_device()
    except ConfigError as e:
        print(f"kvmesh serve: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kvmesh.engine.server.runtime import serve
    from kvmesh.engine.transfer.ucx_env import apply_ucx_defaults

    apply_ucx_defaults()  # before any KV transfer (cache node, prefill/decode) creates ucxx's context

    return serve(settings)


def main(argv: list[str] | None = None) -> int:
    """`python -m kvmesh.engine.server`: the same as `kvmesh serve`."""
    p = argparse.ArgumentParser(prog="kvmesh serve", description="Serve a model over the OpenAI-compatible API.")
    add_serve_arguments(p)
    return handler(p.parse_args(argv))
