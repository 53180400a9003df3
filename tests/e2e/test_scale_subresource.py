"""The /scale subresource on the real API server: `kubectl scale` on an InferenceDeployment (as an
HPA or KEDA would) resizes the decode pool, and the operator keeps the new size."""

from __future__ import annotations

import json

import pytest

from .helpers import IMAGE, condition, wait_until

pytestmark = pytest.mark.e2e

NAME = "scaled"
SPEC = {
    "model": {"name": "smollm2-135m-instruct"}, "image": IMAGE, "prefill": {"replicas": 1},
    "decode": {"replicas": 2}, "cache": {"replicas": 1}, "router": {"replicas": 1},
}


def decode_replicas(cluster, ns):
    dep = cluster.deployments(ns, NAME).get("decode")
    return dep.spec.replicas if dep else None


def scale(cluster, ns) -> dict:
    out = cluster.kubectl("get", "--raw",
                          f"/apis/serving.kvmesh.io/v1alpha1/namespaces/{ns}/inferencedeployments/{NAME}/scale")
    return json.loads(out.stdout)


def test_kubectl_scale_resizes_decode_and_the_operator_keeps_it(cluster, namespace, operator):
    cluster.create_cr(namespace, NAME, SPEC)
    wait_until("decode at 2", lambda: decode_replicas(cluster, namespace) == 2, timeout=60)
    wait_until("Ready", lambda: condition(cluster.get_cr(namespace, NAME) or {}, "Ready").get(
        "status") == "True", timeout=90)
    before = scale(cluster, namespace)
    assert before["spec"]["replicas"] == 2 and before["status"]["replicas"] == 2
    assert "app.kubernetes.io/component=decode" in before["status"]["selector"]

    cluster.kubectl("scale", "inferencedeployment", NAME, "-n", namespace, "--replicas=3")
    assert cluster.get_cr(namespace, NAME)["spec"]["decode"]["replicas"] == 3
    wait_until("decode at 3", lambda: decode_replicas(cluster, namespace) == 3, timeout=60)

    # Another pass (an annotation is a watch event) must leave the external scaler's choice.
    cluster.kubectl("annotate", "inferencedeployment", NAME, "-n", namespace, "touched=1")
    def settled():
        obj = cluster.get_cr(namespace, NAME)
        return (condition(obj, "Ready").get("status") == "True"
                and obj["status"]["components"]["decode"]["desiredReplicas"] == 3)
    wait_until("Ready at 3 decode replicas", settled, timeout=90)
    assert decode_replicas(cluster, namespace) == 3
    after = scale(cluster, namespace)
    assert after["spec"]["replicas"] == 3 and after["status"]["replicas"] == 3
