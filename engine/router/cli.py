"""`kvmesh router`: the cache-aware OpenAI-compatible proxy in front of a pool of engines.

Imported whenever the `kvmesh` parser is built, so nothing heavy is imported at module level.
The flags are a superset of what the operator renders for the router pod
(operator/render.py ``component_args``); a test parses every rendered command line.
"""

from __future__ import annotations

import argparse
import logging
import sys

from kvmesh.engine.api.body_limit import DEFAULT_MAX_REQUEST_BYTES
from kvmesh.engine.api.auth import AuthConfigError, add_auth_arguments, credentials_from_args
from kvmesh.engine.util.cliargs import add_max_request_bytes

POLICIES = ("cache-aware", "session", "least-load", "round-robin")  # == policies.POLICIES (tested)


class RouterArgsError(ValueError):
    """The command line cannot be served; the message says what to change."""


def add_router_arguments(p: argparse.ArgumentParser) -> None:
    r = p.add_argument_group("routing")
    r.add_argument("--policy", choices=POLICIES, default="cache-aware",
                   help="cache-aware: longest cached prefix against load; session: sticky per x-session-id "
                        "header or 'user' field; least-load and round-robin: baselines (default: %(default)s)")
    r.add_argument("--session-idle-s", type=float, default=600.0, metavar="SECONDS",
                   help="forget a session binding after this long without requests (default: %(default)s)")
    r.add_argument("--running-cost-tokens", type=float, default=64.0, metavar="TOKENS",
                   help="load of one running request, in prefill tokens (default: %(default)s)")
    r.add_argument("--max-running-per-engine", type=int, default=128, metavar="N",
                   help="prefer other engines once one has N requests in flight; a session moves off "
                        "such an engine (0: no cap; default: %(default)s)")
    r.add_argument("--max-attempts", type=int, default=3,
                   help="engines to try for one request before answering 503 (default: %(default)s)")
    r.add_argument("--shed-above-running", type=int, default=0, metavar="N",
                   help="answer 429 (Retry-After: 1) to a new request when every engine has N requests in "
                        "flight or more, on the proxy and the ext_proc paths alike (0: never shed; default)")
    r.add_argument("--ext-proc-port", type=int, default=None, metavar="PORT",
                   help="also serve the pick to Envoy as a Gateway API Inference Extension endpoint picker "
                        "(gRPC envoy.service.ext_proc.v3.ExternalProcessor + grpc.health.v1) on this port, on "
                        "--host; the HTTP proxy keeps serving on --port (docs/gateway.md)")
    r.add_argument("--ext-proc-front", choices=("auto", "compiled", "python"), default="auto",
                   help="who carries the ext_proc streams: the compiled front (a small Go program asking this "
                        "router for each pick; built on first use with the Go toolchain), grpc.aio inside this "
                        "process, or auto: compiled where it can be built, else python (default: %(default)s)")

    d = p.add_argument_group("engines")
    d.add_argument("--engines", default=None, metavar="URL,...",
                   help="fixed engine list, e.g. http://127.0.0.1:8001,http://127.0.0.1:8002")
    d.add_argument("--decode-service", default=None, metavar="HOST:PORT",
                   help="headless Service of the decode (or colocated) engines; its DNS name is "
                        "re-resolved to pod addresses every --resolve-interval-s")
    d.add_argument("--prefill-service", default=None, metavar="HOST:PORT",
                   help="headless Service of prefill engines (`kvmesh serve --role prefill`): requests then run "
                        "in two stages, prefill there and decode on the --engines/--decode-service pool "
                        "(`--role decode`); see docs/disagg.md")
    d.add_argument("--prefill-engines", default=None, metavar="URL,...",
                   help="fixed prefill engine list (the --prefill-service of a local setup)")
    d.add_argument("--cache-node", "--cache-service", dest="cache_node", default=None, metavar="HOST:PORT",
                   help="the engines' cache node (or headless Service of them); accepted for the same command "
                        "vocabulary as `kvmesh serve`: remote-tier hits arrive as the engines' KV events")
    d.add_argument("--resolve-interval-s", type=float, default=5.0, metavar="SECONDS")
    d.add_argument("--health-interval-s", type=float, default=2.0, metavar="SECONDS")
    d.add_argument("--sync-timeout-s", type=float, default=60.0, metavar="SECONDS",
                   help="how long startup waits for every engine's KV snapshot (default: %(default)s)")

    pd = p.add_argument_group("prefill/decode disaggregation (with --prefill-service or --prefill-engines)")
    pd.add_argument("--pd-queue-timeout", type=float, default=30.0, metavar="SECONDS",
                    help="how long a request may wait while every decode engine refuses it for lack of KV room "
                         "before it is answered 503 no_decode_capacity (default: %(default)s)")
    pd.add_argument("--pd-max-queued", type=int, default=256, metavar="N",
                    help="requests that may wait that way at once; more are answered 503 at once "
                         "(default: %(default)s)")

    m = p.add_argument_group("model (for tokenizing prompts exactly as the engines do)")
    m.add_argument("--model", default="default",
                   help="'default' (the embedded model), a .gguf file or a safetensors directory; with "
                        "--model-path or --config, the served name only (default: %(default)s)")
    m.add_argument("--model-path", default=None, metavar="PATH",
                   help="read the tokenizer from this .gguf file or model directory")
    m.add_argument("--config", default=None, metavar="FILE",
                   help="the operator's kvmesh.yaml; its model.source.path is used when --model-path is not given")

    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in containers)")
    s.add_argument("--port", type=int, default=8000)
    add_max_request_bytes(s, DEFAULT_MAX_REQUEST_BYTES)
    s.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    s.add_argument("--access-log", action="store_true", help="log every HTTP request")
    add_auth_arguments(p)


def add_router_subcommand(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "router", help="route OpenAI requests to engines by cached prefix and load",
        description="An OpenAI-compatible proxy (/v1/completions, /v1/chat/completions, /v1/models, /health, "
                    "/ready, /metrics) that sends each request to the engine holding its longest cached prefix.")
    add_router_arguments(p)
    p.set_defaults(func=handler)


def tokenizer_source(args: argparse.Namespace) -> str:
    """Where the engines' tokenizer lives: --model-path, else --config's model path, else --model."""
    from kvmesh.engine.util.cliargs import ArgsError, config_model_path

    if args.model_path:
        return args.model_path
    if args.config:
        try:
            path = config_model_path(args.config)
        except ArgsError as e:
            raise RouterArgsError(str(e)) from None
        if path:
            return path
    return args.model


def load_tokenizer(source: str):  # -> Tokenizer (imported lazily)
    """The engines' tokenizer for ``source`` without loading any weights."""
    from pathlib import Path

    from kvmesh.engine.model.fetch import DEFAULT_MODEL_NAME, ensure_default_model
    from kvmesh.engine.model.tokenizer import Tokenizer

    if source in ("default", DEFAULT_MODEL_NAME):
        return Tokenizer.from_gguf(ensure_default_model())
    path = Path(source).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return Tokenizer.from_gguf(path)
    if path.is_dir():
        return Tokenizer.from_dir(path)
    raise RouterArgsError(f"cannot read a tokenizer from {source!r}: expected 'default', a .gguf file or a model "
                          "directory (pass --model-path, or use --policy least-load/round-robin, which need none)")


def settings_from_args(args: argparse.Namespace):  # -> RouterSettings
    from kvmesh.engine.router.app import RouterSettings
    from kvmesh.engine.router.discovery import DiscoveryError, parse_engine_urls, parse_hostport
    from kvmesh.engine.router.policies import LoadModel

    try:
        engines = tuple(parse_engine_urls(args.engines)) if args.engines else ()
        services = (parse_hostport(args.decode_service, "--decode-service"),) if args.decode_service else ()
        prefill_engines = (tuple(parse_engine_urls(args.prefill_engines, "--prefill-engines"))
                           if args.prefill_engines else ())
        prefill_services = ((parse_hostport(args.prefill_service, "--prefill-service"),)
                            if args.prefill_service else ())
        if args.cache_node:
            parse_hostport(args.cache_node, "--cache-node")
    except DiscoveryError as e:
        raise RouterArgsError(str(e)) from None
    if not engines and not services:
        raise RouterArgsError("no engines to route to: pass --engines URL,... or --decode-service HOST:PORT")
    if args.session_idle_s <= 0 or args.max_attempts < 1 or args.max_running_per_engine < 0:
        raise RouterArgsError("--session-idle-s must be > 0, --max-attempts >= 1, --max-running-per-engine >= 0")
    if args.shed_above_running < 0:
        raise RouterArgsError("--shed-above-running must be >= 0 (0: never shed)")
    if args.ext_proc_port is not None and not 0 <= args.ext_proc_port < 65536:
        raise RouterArgsError(f"--ext-proc-port {args.ext_proc_port}: expected a TCP port, 0-65535 (0: any free one)")
    if args.ext_proc_port is not None and args.ext_proc_port == args.port and args.port != 0:
        raise RouterArgsError(f"--ext-proc-port and --port are both {args.port}: the gRPC picker and the HTTP proxy "
                              "need a port each")
    if args.pd_queue_timeout < 0 or args.pd_max_queued < 0:
        raise RouterArgsError("--pd-queue-timeout and --pd-max-queued must be >= 0 (0: answer 503 as soon as every "
                              "decode engine refused)")
    try:
        auth = credentials_from_args(args)
    except AuthConfigError as e:
        raise RouterArgsError(str(e)) from None
    overlap = set(engines) & set(prefill_engines)
    if overlap:
        raise RouterArgsError(f"{', '.join(sorted(overlap))} is in both --engines and --prefill-engines; an engine "
                              "serves one role (--engines lists the decode engines)")
    return RouterSettings(
        policy=args.policy, engines=engines, services=services, prefill_engines=prefill_engines,
        prefill_services=prefill_services, pd_queue_timeout_s=args.pd_queue_timeout,
        pd_max_queued=args.pd_max_queued, session_idle_s=args.session_idle_s,
        load=LoadModel(args.running_cost_tokens, args.max_running_per_engine, shed_running=args.shed_above_running),
        max_attempts=args.max_attempts, ext_proc_port=args.ext_proc_port, ext_proc_host=args.host,
        ext_proc_front=args.ext_proc_front,
        resolve_interval_s=args.resolve_interval_s, health_interval_s=args.health_interval_s,
        sync_timeout_s=args.sync_timeout_s, max_request_bytes=args.max_request_bytes, auth=auth)


def handler(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("kvmesh.router")
    try:
        settings = settings_from_args(args)
        tokenizer = None
        from kvmesh.engine.router.policies import uses_prefix

        source = tokenizer_source(args) if uses_prefix(args.policy) else None
    except RouterArgsError as e:
        print(f"kvmesh router: {e}", file=sys.stderr)
        return 2
    if source is not None:
        try:
            tokenizer = load_tokenizer(source)
        except Exception as e:  # noqa: BLE001 - the engines have it (GET /kv/tokenizer)
            log.warning("cannot read the tokenizer here (%s); policy %s takes it from the first healthy "
                        "engine and /ready answers 503 until then", e, args.policy)
    import uvicorn

    from kvmesh.engine.router.app import RouterApp

    app = RouterApp(settings, tokenizer)
    config = uvicorn.Config(app, host=args.host, port=args.port, loop="uvloop", http="httptools",
                            lifespan="on", log_level=args.log_level, access_log=args.access_log,
                            timeout_graceful_shutdown=30)
    server = uvicorn.Server(config)
    server.run()
    return 0 if server.started else 1
