"""Two operator replicas on one Lease: exactly one reconciles; when it dies
without releasing the Lease, the standby takes over after the lease expires."""

from __future__ import annotations

import time

import pytest
from kubernetes import client

from .helpers import IMAGE, OperatorProcess, condition, wait_until

pytestmark = pytest.mark.e2e

SPEC = {"model": {"name": "smollm2-135m-instruct"}, "image": IMAGE, "prefill": {"replicas": 0},
        "decode": {"replicas": 1}, "cache": {"replicas": 0}, "router": {"replicas": 1}}
LEASE = ["--lease-duration", "4", "--renew-deadline", "3", "--retry-period", "0.5"]


def test_one_leader_and_failover(cluster, crd_installed, namespace, tmp_path):
    common = ["--namespace", namespace, "--lease-namespace", namespace, *LEASE]
    coord = client.CoordinationV1Api(cluster.api)
    a = OperatorProcess.start(cluster.kubeconfig, tmp_path / "a.log", "--identity", "a", *common)
    b = None
    try:
        wait_until("a leads", a.is_leader, timeout=30)
        b = OperatorProcess.start(cluster.kubeconfig, tmp_path / "b.log", "--identity", "b",
                                  *common)
        time.sleep(3)
        assert a.is_leader() and not b.is_leader()
        assert coord.read_namespaced_lease("kvmesh-operator", namespace).spec.holder_identity == "a"

        cluster.create_cr(namespace, "colocated", SPEC)
        wait_until("Ready under a", lambda: condition(cluster.get_cr(namespace, "colocated"),
                                                      "Ready").get("status") == "True", timeout=90)
        # The standby never started its watches, so it cannot have reconciled.
        assert "kopf" not in b.log.read_text(), b.tail()
        assert b.probe("/readyz") == 200  # yet it counts as ready (rolling updates finish)

        killed_at = time.monotonic()
        a.stop(sig_kill=True)  # no chance to release the Lease
        wait_until("b takes over", b.is_leader, timeout=30)
        took = time.monotonic() - killed_at
        assert took >= 2, f"b took over after {took:.1f}s, before a's lease could expire"
        assert coord.read_namespaced_lease("kvmesh-operator", namespace).spec.holder_identity == "b"

        cluster.patch_cr(namespace, "colocated", {"spec": {"decode": {"replicas": 2}}})
        wait_until("b reconciles the edit", lambda: cluster.deployments(
            namespace, "colocated")["decode"].spec.replicas == 2, timeout=60)
    finally:
        a.stop()
        if b is not None:
            b.stop()
    # b released the Lease on a clean stop.
    assert not coord.read_namespaced_lease("kvmesh-operator", namespace).spec.holder_identity
