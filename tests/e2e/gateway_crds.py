"""The Gateway API and Gateway API Inference Extension CRDs, from their Go modules at the versions
e2e/versions.env pins (the module proxy serves them; no image or other download), installed into
the test apiserver the way a cluster administrator installs them."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from .helpers import ROOT, Cluster

GIE_MODULE = "sigs.k8s.io/gateway-api-inference-extension"
GATEWAY_API_MODULE = "sigs.k8s.io/gateway-api"


def pinned(name: str) -> str:
    for line in (ROOT / "e2e" / "versions.env").read_text().splitlines():
        if line.startswith(f"{name}="):
            return line.split("=", 1)[1].strip()
    raise KeyError(f"{name} is not pinned in e2e/versions.env")


def module_dir(module: str, version: str) -> Path:
    """The module's source tree in Go's module cache (downloaded once, verified by go.sum's db)."""
    out = subprocess.run(["go", "mod", "download", "-json", f"{module}@{version}"], capture_output=True,
                         text=True, timeout=600)
    info = json.loads(out.stdout or "{}")
    if out.returncode != 0 or "Dir" not in info:
        raise RuntimeError(f"go mod download {module}@{version} failed: {info.get('Error') or out.stderr}")
    return Path(info["Dir"])


def install_gateway_crds(cluster: Cluster) -> None:
    """InferencePool (inference.networking.k8s.io/v1) and the standard Gateway API CRDs, Established."""
    files = [module_dir(GIE_MODULE, pinned("GIE_VERSION")) / "config/crd/bases/"
             "inference.networking.k8s.io_inferencepools.yaml",
             module_dir(GATEWAY_API_MODULE, pinned("GATEWAY_API_VERSION")) / "config/crd/standard"]
    for f in files:
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(f))
    cluster.wait_crds_established("inferencepools.inference.networking.k8s.io",
                                  "httproutes.gateway.networking.k8s.io")
