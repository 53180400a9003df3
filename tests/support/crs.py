"""InferenceDeployment objects for tests: the smallest valid spec and a CR around a spec."""

from __future__ import annotations

import copy

MINIMAL_SPEC = {
    "model": {"name": "smollm2-135m-instruct"},
    "prefill": {"replicas": 1},
    "decode": {"replicas": 2},
    "cache": {"replicas": 1},
    "router": {"replicas": 1},
    "slo": {"ttftMs": 500, "tpotMs": 50},
}


def make_cr(spec=None, name="llm", namespace="serving", uid="uid-1", generation=1, status=None):
    obj = {
        "apiVersion": "serving.kvmesh.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": name, "namespace": namespace, "uid": uid, "generation": generation},
        "spec": copy.deepcopy(MINIMAL_SPEC if spec is None else spec),
    }
    if status is not None:
        obj["status"] = status
    return obj
