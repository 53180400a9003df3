"""InferenceDeployment objects for tests: the smallest valid spec and a CR around a spec."""

from __future__ import annotations

import copy
from pathlib import Path

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


def mount_auth_secret(argv: list[str], directory: Path) -> list[str]:
    """``argv`` with the auth Secret's mount path replaced by a file in ``directory`` holding a
    token, as the kubelet would mount it (the CLI reads the file when it parses)."""
    from kvmesh.operator.render import AUTH_TOKEN_FILE

    token = directory / "auth-token"
    token.write_text("a-test-token\n")
    return [str(token) if a == AUTH_TOKEN_FILE else a for a in argv]
