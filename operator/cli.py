"""`kvmesh operator`: argument parsing for the operator process.

`add_operator_subcommand(subparsers)` registers the subcommand on the
project's CLI; `python -m kvmesh.operator` runs the same parser standalone.
The API server is found the standard way: $KUBECONFIG (or ~/.kube/config),
else the pod's in-cluster service account.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from .app import OperatorOptions, run_operator


def _positive(value: str) -> float:
    number = float(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return number


def configure_parser(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", dest="namespaces", default=[],
                       metavar="NS", help="watch only this namespace (repeatable)")
    scope.add_argument("-A", "--all-namespaces", action="store_true",
                       help="watch every namespace (the default)")
    le = parser.add_mutually_exclusive_group()
    le.add_argument("--leader-election", dest="leader_election", action="store_true",
                    default=True, help="hold a Lease so only one replica reconciles (default)")
    le.add_argument("--standalone", dest="leader_election", action="store_false",
                    help="reconcile without leader election (a single replica only)")
    parser.add_argument("--kubeconfig", default=None, metavar="PATH",
                        help="kubeconfig to use (default: $KUBECONFIG, ~/.kube/config, "
                             "then the in-cluster service account)")
    parser.add_argument("--lease-name", default="kvmesh-operator")
    parser.add_argument("--lease-namespace", default=None,
                        help="namespace of the Lease (default: $POD_NAMESPACE, the pod's "
                             "namespace, or 'default')")
    parser.add_argument("--lease-duration", type=_positive, default=15.0, metavar="S",
                        help="seconds a standby waits after the last renewal (default 15)")
    parser.add_argument("--renew-deadline", type=_positive, default=10.0, metavar="S",
                        help="a leader that cannot renew for this long steps down (default 10)")
    parser.add_argument("--retry-period", type=_positive, default=2.0, metavar="S",
                        help="seconds between lease attempts/renewals (default 2)")
    parser.add_argument("--identity", default=None,
                        help="this replica's name in the Lease (default: $POD_NAME or host-pid)")
    parser.add_argument("--health-port", type=int, default=8080,
                        help="port for /healthz, /readyz and /leader; 0 disables (default 8080)")
    parser.add_argument("--health-host", default="0.0.0.0")
    parser.add_argument("--resync-period", type=_positive, default=60.0, metavar="S",
                        help="reconcile every object this often as a backstop (default 60)")
    parser.add_argument("--prometheus-url", default=None, metavar="URL",
                        help="autoscaler metrics from this Prometheus (HTTP API); default: scrape "
                             "the pools' pods' /metrics directly")
    parser.add_argument("--autoscale-period", type=_positive, default=15.0, metavar="S",
                        help="how often the autoscaler samples and decides (default 15; keep it "
                             "well under metricsWindowSeconds)")
    parser.add_argument("--drain-lease", type=_positive, default=120.0, metavar="S",
                        help="a drained engine serves again unless the operator renews its drain "
                             "within this many seconds (renewed every autoscale period; default "
                             "120: long enough for a leader change)")
    parser.add_argument("--log-level", default=os.environ.get("KVMESH_LOG_LEVEL", "INFO"),
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def options_from_args(args: argparse.Namespace) -> OperatorOptions:
    if args.renew_deadline >= args.lease_duration:
        raise SystemExit(
            f"--renew-deadline ({args.renew_deadline}s) must be shorter than --lease-duration "
            f"({args.lease_duration}s), or two replicas could both think they lead"
        )
    if args.drain_lease < 3 * args.autoscale_period:
        raise SystemExit(
            f"--drain-lease ({args.drain_lease}s) must be at least three --autoscale-period "
            f"({args.autoscale_period}s), or a slow tick lets a drained engine serve again mid-drain"
        )
    return OperatorOptions(
        namespaces=list(args.namespaces),
        leader_election=args.leader_election,
        lease_name=args.lease_name,
        lease_namespace=args.lease_namespace,
        lease_duration_s=max(1, round(args.lease_duration)),
        renew_deadline_s=args.renew_deadline,
        retry_period_s=args.retry_period,
        identity=args.identity,
        health_host=args.health_host,
        health_port=args.health_port or None,
        resync_s=args.resync_period,
        prometheus_url=args.prometheus_url,
        autoscale_s=args.autoscale_period,
        drain_lease_s=args.drain_lease,
    )


def handler(args: argparse.Namespace) -> int:
    opts = options_from_args(args)
    if args.kubeconfig:
        # Both the kubernetes client and kopf's login read it from here.
        os.environ["KUBECONFIG"] = args.kubeconfig
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.log_level != "DEBUG":
        # kopf logs every successful handler call at INFO: one line per watch event.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
        # httpx logs every request at INFO: the autoscaler's scrapes, several per pod per period.
        logging.getLogger("httpx").setLevel(logging.WARNING)
    return asyncio.run(run_operator(opts))


def add_operator_subcommand(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "operator",
        help="run the Kubernetes operator for InferenceDeployment objects",
        description="Reconcile InferenceDeployment objects into their prefill, decode, "
                    "cache and router pools.",
    )
    configure_parser(parser)
    parser.set_defaults(func=handler)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvmesh.operator")
    configure_parser(parser)
    return handler(parser.parse_args(argv))
