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
    """``argv`` with the auth Secret's (and the client keys Secret's) mount paths replaced by files
    in ``directory``, as the kubelet would mount them (the CLI reads the files when it parses)."""
    from kvmesh.operator.render import API_KEYS_FILE, AUTH_TOKEN_FILE

    token, keys = directory / "auth-token", directory / "api-keys"
    token.write_text("a-test-token\n")
    keys.write_text("a-client-key\n")
    return [str(token) if a == AUTH_TOKEN_FILE else str(keys) if a == API_KEYS_FILE else a for a in argv]
