"""`kvmesh cache-node`: a KV block store for engines, reached over UCX.

Imported whenever the `kvmesh` parser is built, so nothing heavy (ucxx, numpy) at module level.
The operator runs `kvmesh cache-node --memory <quantity> --host 0.0.0.0 --port 8000 --config FILE`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from kvmesh.engine.api.auth import AuthConfigError, add_auth_arguments, credentials_from_args
from kvmesh.engine.util.cliargs import parse_size, port_or_zero


def add_cache_node_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--memory", type=parse_size, default=None, metavar="SIZE",
                   help="KV capacity, e.g. 8Gi or 512MiB (the CRD's cache.memory; default: cache.memory "
                        "from --config)")
    p.add_argument("--host", default="0.0.0.0", help="address of the HTTP port (default: %(default)s)")
    p.add_argument("--port", type=port_or_zero, default=8000,
                   help="HTTP port: /health, /ready, /metrics, /kv/snapshot, /kv/info (default: %(default)s)")
    p.add_argument("--ucx-port", type=port_or_zero, default=None, metavar="PORT",
                   help="UCX port for block transfers (default: --port + 1; the listener binds every interface)")
    p.add_argument("--config", default=None, metavar="FILE", help="kvmesh.yaml written by the operator")
    p.add_argument("--node-id", default="", help="name in KV events and /kv/info (default: the host name)")
    p.add_argument("--kv-events-port", type=port_or_zero, default=0, metavar="PORT",
                   help="publish KV events (tier remote) on PORT, replay on PORT+1; 0: off (default)")
    p.add_argument("--kv-events-host", default=None, metavar="ADDR", help="address of the KV event sockets "
                                                                         "(default: --host)")
    p.add_argument("--payload-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="how long a put's block data may take to arrive (default: %(default)s)")
    p.add_argument("--message-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="how long the rest of a request (or a new connection's hello) may take once its first "
                        "bytes arrived; a connection that stalls longer is closed (default: %(default)s)")
    p.add_argument("--max-inflight", type=parse_size, default=None, metavar="SIZE",
                   help="bytes of offered blocks still on the wire, all connections together; memory use is at "
                        "most --memory plus this (default: the smaller of --memory and 256MiB)")
    p.add_argument("--max-put", type=parse_size, default=64 << 20, metavar="SIZE",
                   help="bytes one put (one connection at a time) may have in flight (default: 64MiB)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    add_auth_arguments(p, client_keys=False)


def add_cache_node_subcommand(sub: Any) -> None:
    p = sub.add_parser("cache-node", help="run a KV cache node (blocks in RAM, served over UCX)",
                       description=__doc__.split("\n\n")[0])
    add_cache_node_arguments(p)
    p.set_defaults(func=run_cache_node)


def memory_from_config(path: str) -> int | None:
    """``cache.memory`` from the operator's kvmesh.yaml, in bytes (None when absent)."""
    import yaml

    with open(path, encoding="utf-8") as f:
        doc = yaml.safe_load(f) or {}
    value = (doc.get("cache") or {}).get("memory") if isinstance(doc, dict) else None
    return None if value is None else parse_size(str(value))


def settings_from_args(args: argparse.Namespace) -> Any:
    from .node import NodeSettings

    memory = args.memory
    if memory is None and args.config:
        try:
            memory = memory_from_config(args.config)
        except (OSError, argparse.ArgumentTypeError) as e:
            raise SystemExit(f"kvmesh cache-node: cannot read cache.memory from {args.config}: {e}") from None
    if memory is None:
        raise SystemExit("kvmesh cache-node: give --memory (e.g. 8Gi) or a --config with cache.memory")
    if args.kv_events_port == 65535:
        raise SystemExit("kvmesh cache-node: --kv-events-port must leave room for the replay port (+1)")
    ucx_port = args.ucx_port if args.ucx_port is not None else (args.port + 1 if args.port else 0)
    try:
        auth = credentials_from_args(args)
    except AuthConfigError as e:
        raise SystemExit(f"kvmesh cache-node: {e}") from None
    return NodeSettings(memory=memory, host=args.host, port=args.port, ucx_port=ucx_port, node_id=args.node_id,
                        kv_events_port=args.kv_events_port, kv_events_host=args.kv_events_host or "",
                        payload_timeout=args.payload_timeout, message_timeout=args.message_timeout,
                        max_inflight=args.max_inflight or min(memory, 256 << 20), max_put=args.max_put, auth=auth)


def run_cache_node(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = settings_from_args(args)
    from ..transfer.ucx_env import apply_ucx_defaults

    apply_ucx_defaults(settings.host)  # before ucxx creates its context, below
    import asyncio

    from .node import serve

    asyncio.run(serve(settings))
    return 0
