"""The `kvmesh` command: one CLI for every role of the one image."""

from __future__ import annotations

import argparse
import importlib
import sys

# (module, function) pairs that register subcommands; each sets `func` on its parser.
_SUBCOMMANDS = (
    ("kvmesh.engine.model.fetch", "add_model_subcommands"),
    ("kvmesh.engine.server.cli", "add_serve_subcommand"),
    ("kvmesh.engine.router.cli", "add_router_subcommand"),
    ("kvmesh.engine.generate_cli", "add_generate_subcommand"),
    ("kvmesh.engine.cachenode.cli", "add_cache_node_subcommand"),
    ("kvmesh.operator.cli", "add_operator_subcommand"),
    ("kvmesh.operator.dashboard_cli", "add_dashboard_subcommand"),
    ("kvmesh.up", "add_up_subcommand"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmesh", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module, func in _SUBCOMMANDS:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("kvmesh"):
                continue  # a role not built into this distribution
            raise
        getattr(mod, func)(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
