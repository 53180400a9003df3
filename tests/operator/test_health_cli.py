import argparse

import pytest

from kvmesh.operator.cli import add_operator_subcommand, options_from_args
from kvmesh.operator.health import HealthState, respond


def test_health_endpoints():
    state = HealthState("op-1", is_leader=lambda: False)
    assert respond(state, "/healthz") == (200, {"ok": True})
    assert respond(state, "/readyz")[0] == 503
    state.started = True
    assert respond(state, "/readyz")[0] == 200
    assert respond(state, "/leader") == (503, {"leader": False, "identity": "op-1"})
    state.is_leader = lambda: True
    assert respond(state, "/leader?verbose=1")[0] == 200
    assert respond(state, "/nope")[0] == 404


def parse(*argv):
    parser = argparse.ArgumentParser(prog="kvmesh")
    add_operator_subcommand(parser.add_subparsers(dest="cmd"))
    return parser.parse_args(["operator", *argv])


def test_subcommand_defaults():
    args = parse()
    opts = options_from_args(args)
    assert callable(args.func)
    assert opts.namespaces == [] and opts.leader_election and opts.health_port == 8080


def test_subcommand_options():
    opts = options_from_args(parse("-n", "a", "-n", "b", "--standalone", "--health-port", "0",
                                   "--lease-duration", "4", "--renew-deadline", "3"))
    assert opts.namespaces == ["a", "b"] and not opts.leader_election
    assert opts.health_port is None and opts.lease_duration_s == 4


def test_renew_deadline_must_be_shorter_than_lease():
    with pytest.raises(SystemExit, match="renew-deadline"):
        options_from_args(parse("--lease-duration", "5", "--renew-deadline", "5"))


def test_namespace_and_all_namespaces_are_exclusive():
    with pytest.raises(SystemExit):
        parse("-n", "a", "--all-namespaces")


def test_the_drain_lease_must_outlast_several_autoscale_periods():
    assert options_from_args(parse()).drain_lease_s == 120
    assert options_from_args(parse("--autoscale-period", "2", "--drain-lease", "6")).drain_lease_s == 6
    with pytest.raises(SystemExit, match="drain-lease"):
        options_from_args(parse("--autoscale-period", "15", "--drain-lease", "30"))
