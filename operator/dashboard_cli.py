"""`kvmesh dashboard generate` (the Grafana JSON) and `kvmesh dashboard snapshot` (PNGs)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from . import dashboards


def _generate(args: argparse.Namespace) -> int:
    for out in args.out:
        for path in dashboards.write_files(Path(out)):
            print(path)
    return 0


def _snapshot(args: argparse.Namespace) -> int:
    from .dashboard_snapshot import PrometheusQueryError, SnapshotUnavailable, render

    values = dashboards.default_values(args.namespace, args.deployment, args.rate_interval)
    choices = {v.name: v.options for v in dashboards.VARIABLES if v.options}
    for name in ("percentile", "ttft_slo", "tpot_slo"):
        value = getattr(args, name)
        if value is None:
            continue
        # le="0.30" matches no bucket (the exposition writes 0.3): refuse rather than draw nothing.
        if name != "percentile" and value not in choices[name]:
            print(f"kvmesh dashboard snapshot: --{name.replace('_', '-')} {value} is not a bucket bound; "
                  f"choose one of {', '.join(choices[name])}", file=sys.stderr)
            return 2
        values[name] = value
    end = time.time() if args.end is None else args.end
    start = end - args.minutes * 60 if args.start is None else args.start
    try:
        paths = render(args.prometheus, values, start, end, Path(args.out), step_s=args.step)
    except (PrometheusQueryError, SnapshotUnavailable) as exc:
        print(f"kvmesh dashboard snapshot: {exc}", file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    return 0


def add_dashboard_subcommand(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dashboard", help="Grafana SLO dashboard: generate its JSON, snapshot it to PNG")
    dsub = p.add_subparsers(dest="dashboard_command", metavar="ACTION", required=True)
    g = dsub.add_parser("generate", help="write the dashboard JSON files")
    g.add_argument("--out", action="append", required=True, metavar="DIR",
                   help="directory to write into (repeatable); other *.json there are removed")
    g.set_defaults(func=_generate)
    s = dsub.add_parser("snapshot", help="render the SLO panels to PNG from Prometheus")
    s.add_argument("--prometheus", required=True, metavar="URL", help="Prometheus base URL")
    s.add_argument("--out", required=True, metavar="DIR")
    s.add_argument("--namespace", required=True)
    s.add_argument("--deployment", required=True, help="the InferenceDeployment's name")
    s.add_argument("--minutes", type=float, default=15.0, help="range ending now (default 15)")
    s.add_argument("--start", type=float, default=None, help="range start, Unix seconds")
    s.add_argument("--end", type=float, default=None, help="range end, Unix seconds (default now)")
    s.add_argument("--step", type=float, default=5.0, help="seconds between points (default 5)")
    s.add_argument("--rate-interval", default="1m",
                   help="what $__rate_interval stands for: at least 4 scrape intervals (default 1m)")
    s.add_argument("--percentile", default=None, help="SLO percentile as a fraction (default 0.95)")
    s.add_argument("--ttft-slo", default=None, help="TTFT SLO in seconds, a bucket bound (default 1.0)")
    s.add_argument("--tpot-slo", default=None, help="TPOT SLO in seconds, a bucket bound (default 0.05)")
    s.set_defaults(func=_snapshot)
