"""Fixtures for the e2e suite: one real control plane for the package.

By default `e2e/cluster up` starts etcd, kube-apiserver,
kube-controller-manager, kube-scheduler and kwok (fake GPU and CPU nodes) in a
temporary directory, and `e2e/cluster down` stops them after the last e2e test. Only with
$KVMESH_E2E_KUBECONFIG set (kind with a GPU node pool, say; $KUBECONFIG alone is
ignored) the suite runs against that cluster instead and leaves it running; helm
and kubectl then come from PATH, or from the harness's cache when PATH has none.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from .helpers import CPU_POOL_PLACEMENT, IMAGE, ROOT, Cluster, OperatorProcess, external_kubeconfig, wait_until

CLUSTER = ROOT / "e2e" / "cluster"
BUILD = ROOT / "e2e" / "build-binaries"


def pytest_collection_modifyitems(items) -> None:
    # The first e2e test's setup may include a cold build of the control plane
    # (about 20 minutes on 2 cores), which must not count against the
    # per-test timeout meant for the tests themselves.
    for item in items:
        if item.get_closest_marker("e2e") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(3600))


def _cached_bin_dirs() -> list[Path]:
    out = subprocess.run([str(BUILD), "--print-dirs"], capture_output=True, text=True,
                         check=True).stdout
    return [Path(line.split("=", 1)[1]) for line in out.split()]


# Package scope, not session: the control plane (and the real node's kubelet and containers) stops
# when the last e2e test ends, so it does not load the 2-core machine under the suites after it.
@pytest.fixture(scope="package")
def cluster(tmp_path_factory) -> Cluster:
    external = external_kubeconfig(dict(os.environ))
    if external is not None:
        needed = [t for t in ("kubectl", "helm") if shutil.which(t) is None]
        if needed:  # take them from the harness's cache (built if missing)
            subprocess.run([str(BUILD), "kubernetes", "helm"], check=True)
        yield Cluster(external, _cached_bin_dirs(), local=False)
        return
    state = tmp_path_factory.mktemp("cluster") / "state"
    started = time.monotonic()
    # KVMESH_E2E_REAL_NODE=1 adds one real kubelet node (root, scripts/setup-e2e-node) for
    # the tests that run the kvmesh image (test_real_pods.py); they skip without it.
    real = ["--real-node"] if os.environ.get("KVMESH_E2E_REAL_NODE") == "1" else []
    result = subprocess.run([str(CLUSTER), "up", str(state), *real], text=True,
                            stdout=subprocess.PIPE, timeout=3600)
    if result.returncode != 0:
        pytest.fail(f"e2e/cluster up failed (exit {result.returncode}); see the output above "
                    f"and the logs in {state / 'logs'}")
    print(f"\nlocal control plane up in {time.monotonic() - started:.1f}s")
    try:
        yield Cluster(Path(result.stdout.strip().splitlines()[-1]), _cached_bin_dirs(),
                      local=True)
    finally:
        subprocess.run([str(CLUSTER), "down", str(state)], timeout=120)


@pytest.fixture(scope="package")
def crd_installed(cluster: Cluster) -> None:
    """The CRD from crds/, applied the way a user would, and Established."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
    cluster.wait_crds_established("inferencedeployments.serving.kvmesh.io")


RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted",
              "pod-security.kubernetes.io/enforce-version": "latest"}


@pytest.fixture(scope="module")
def namespace(cluster: Cluster, request) -> str:
    module = request.module.__name__.rsplit(".", 1)[-1]
    name = "e2e-" + module.removeprefix("test_").replace("_", "-")
    # Where the kvmesh image really runs, the apiserver's PodSecurity admission holds every pod to
    # the "restricted" standard: a rendered pod that fell short would never start.
    cluster.create_namespace(name, RESTRICTED if module.startswith("test_real_pods") else None)
    wait_until("default ServiceAccount", lambda: cluster.core.list_namespaced_service_account(
        name, field_selector="metadata.name=default").items, timeout=60)
    yield name
    cluster.delete_namespace(name)


@pytest.fixture(scope="package")
def real_placement(cluster: Cluster) -> dict:
    """For the tests that run the kvmesh image (test_real_pods*.py): the image built and imported
    once per session, and the placement (nodeSelector, tolerations) that puts pods on a node that
    runs containers. Skips unless the cluster has one (KVMESH_E2E_REAL_NODE=1, or
    KVMESH_E2E_REAL_PODS=1 on an external cluster with the image loaded)."""
    if cluster.local and not cluster.real_node:
        pytest.skip("the local cluster has no real node (set KVMESH_E2E_REAL_NODE=1)")
    if not cluster.local and os.environ.get("KVMESH_E2E_REAL_PODS") != "1":
        pytest.skip("real pods on an external cluster need KVMESH_E2E_REAL_PODS=1 and the image loaded")
    if cluster.local:
        started = time.monotonic()
        subprocess.run([str(ROOT / "e2e" / "image" / "build"), "--tag", IMAGE], check=True,
                       timeout=3600)
        built = time.monotonic()
        subprocess.run([str(CLUSTER), "load-image", str(cluster.state_dir), IMAGE], check=True,
                       timeout=1800)
        print(f"\nimage built in {built - started:.0f}s, imported in {time.monotonic() - built:.0f}s")
    if cluster.core.list_node(label_selector="kvmesh.io/real-node=true").items:
        return {  # the local cluster's real node is tainted so that nothing else lands there
            "nodeSelector": {"kvmesh.io/real-node": "true"},
            "tolerations": [{"key": "kvmesh.io/real-node", "operator": "Exists",
                             "effect": "NoSchedule"}],
        }
    return CPU_POOL_PLACEMENT


@pytest.fixture(scope="module")
def router_url(cluster: Cluster, deployment: str, request):
    """The router of the module's `deployment` (its CR is the module's NAME), through
    `kubectl port-forward` to its Service."""
    from .realpods import router_port_forward

    with router_port_forward(cluster, deployment, request.module.NAME) as url:
        yield url


@pytest.fixture(scope="package")
def hf_reference():
    """transformers' fp32 greedy tokens for the default model (see realpods.HFReference)."""
    from .realpods import HFReference

    return HFReference()


@pytest.fixture(scope="module")
def operator(cluster: Cluster, crd_installed, namespace: str, tmp_path_factory, request):
    """The operator, run as the admin user, watching the module's namespace (a module's
    OPERATOR_ARGS are added to its command line)."""
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    op = OperatorProcess.start(cluster.kubeconfig, log, "--namespace", namespace,
                               "--lease-namespace", namespace, "--resync-period", "20",
                               *getattr(request.module, "OPERATOR_ARGS", ()))
    wait_until("operator to lead", op.is_leader, timeout=30)
    yield op
    op.stop()
    print(f"\n--- operator log ({log}) ---\n{op.tail(30)}")
