"""Gateway mode against the real control plane: the operator's InferencePool and HTTPRoute are
accepted by the upstream CRDs (installed from their Go modules, so the API server validates them
with the real schemas), follow spec edits (a route removed, proxy mode restored) and go with the CR.

Real: kube-apiserver, the garbage collector, the upstream CRDs, the operator process. Fake: kwok
nodes (no engine runs here; a gateway reaching real engine pods through kvmesh's picker is
test_real_pods_gateway.py). The tests share one CR and run in file order."""

from __future__ import annotations

import pytest

from kvmesh.operator import gateway as gw

from .gateway_crds import install_gateway_crds
from .helpers import IMAGE, wait_until

pytestmark = pytest.mark.e2e

NAME = "gated"
SPEC = {
    "model": {"name": "smollm2-135m-instruct"},
    "image": IMAGE,
    "prefill": {"replicas": 0},
    "decode": {"replicas": 1},
    "cache": {"replicas": 0},
    "router": {"replicas": 1, "mode": "gateway",
               "gateway": {"parentRef": {"name": "inference-gateway", "sectionName": "http"}}},
}


@pytest.fixture(scope="module", autouse=True)
def crds(cluster):
    install_gateway_crds(cluster)


def _get(cluster, ns: str, kind: str, name: str) -> dict | None:
    return cluster.get_custom(*gw.RESOURCES[kind], ns, name)


def test_the_pool_and_route_are_created_as_rendered(cluster, namespace, operator):
    cluster.create_cr(namespace, NAME, SPEC)
    pool = wait_until("InferencePool", lambda: _get(cluster, namespace, gw.POOL_KIND, f"{NAME}-pool"))
    route = wait_until("HTTPRoute", lambda: _get(cluster, namespace, gw.ROUTE_KIND, f"{NAME}-route"))
    decode = cluster.apps.read_namespaced_deployment(f"{NAME}-decode", namespace)
    assert pool["spec"]["selector"]["matchLabels"] == decode.spec.selector.match_labels
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    ref = pool["spec"]["endpointPickerRef"]
    assert (ref["name"], ref["port"], ref["failureMode"]) == (f"{NAME}-router", {"number": gw.EXT_PROC_PORT},
                                                             "FailClose")
    router_ports = {p.port for p in cluster.core.read_namespaced_service(f"{NAME}-router", namespace).spec.ports}
    assert gw.EXT_PROC_PORT in router_ports
    assert route["spec"]["parentRefs"][0]["name"] == "inference-gateway"
    assert route["spec"]["rules"][0]["backendRefs"][0]["name"] == f"{NAME}-pool"
    wait_until("status names the pool", lambda: (cluster.get_cr(namespace, NAME).get("status") or {}).get(
        "inferencePool") == f"{NAME}-pool")


def test_removing_the_parent_ref_removes_the_route_only(cluster, namespace, operator):
    cluster.patch_cr(namespace, NAME, {"spec": {"router": {"gateway": {"parentRef": None}}}})
    wait_until("HTTPRoute deleted", lambda: _get(cluster, namespace, gw.ROUTE_KIND, f"{NAME}-route") is None)
    assert _get(cluster, namespace, gw.POOL_KIND, f"{NAME}-pool") is not None


def test_proxy_mode_removes_the_pool(cluster, namespace, operator):
    cluster.patch_cr(namespace, NAME, {"spec": {"router": {"mode": "proxy", "gateway": None}}})
    wait_until("InferencePool deleted", lambda: _get(cluster, namespace, gw.POOL_KIND, f"{NAME}-pool") is None)
    wait_until("status drops the pool", lambda: not (cluster.get_cr(namespace, NAME).get("status") or {}).get(
        "inferencePool"))


def test_deleting_the_resource_removes_the_pool(cluster, namespace, operator):
    cluster.patch_cr(namespace, NAME, {"spec": {"router": {"mode": "gateway"}}})
    wait_until("InferencePool back", lambda: _get(cluster, namespace, gw.POOL_KIND, f"{NAME}-pool"))
    cluster.custom.delete_namespaced_custom_object("serving.kvmesh.io", "v1alpha1", namespace,
                                                   "inferencedeployments", NAME)
    wait_until("InferencePool garbage-collected",
               lambda: _get(cluster, namespace, gw.POOL_KIND, f"{NAME}-pool") is None, timeout=90)
