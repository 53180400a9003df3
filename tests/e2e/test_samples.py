"""The sample InferenceDeployment the README shows, applied as a user would.

Real: `kubectl apply -f config/samples/inferencedeployment.yaml` (strict field validation, kubectl's
default) against the real kube-apiserver with the CRD installed, the operator reconciling it, the
real scheduler placing its pools, and `kubectl get inferencedeployments` printing the CRD's columns.
Fake: kwok marks the pods Ready without running them (the image itself runs in test_real_pods*.py).
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from tests.support.readme import readme_block, readme_line

from .helpers import ROOT, condition, wait_until

pytestmark = pytest.mark.e2e

SAMPLE = ROOT / "config" / "samples" / "inferencedeployment.yaml"


def sample() -> dict:
    return yaml.safe_load(Path(SAMPLE).read_text())


def readme_kubectl(prefix: str) -> list[str]:
    """The README's `kubectl ...` line starting with `prefix`, as argv after `kubectl`."""
    return shlex.split(readme_line("bash", prefix))[1:]


def test_the_sample_applies_and_reconciles_into_its_pools(cluster, namespace, operator):
    """The README's two kubectl commands as written, from the repository root, in this module's
    namespace (the README's run in the current context's namespace)."""
    doc = sample()
    name = doc["metadata"]["name"]
    apply = readme_kubectl("kubectl apply -f ")
    assert apply == ["apply", "-f", str(SAMPLE.relative_to(ROOT))], apply
    cluster.kubectl(*apply, "-n", namespace, cwd=ROOT)
    obj = wait_until("the sample Ready", lambda: (o := cluster.get_cr(namespace, name))
                     and condition(o, "Ready").get("status") == "True"
                     and o["status"]["observedGeneration"] == o["metadata"]["generation"] and o, timeout=120)
    spec = doc["spec"]
    want = {c: f"{spec[c]['replicas']}/{spec[c]['replicas']}" for c in ("prefill", "decode", "cache", "router")}
    assert {c: obj["status"]["components"][c]["ready"] for c in want} == want
    assert set(cluster.deployments(namespace, name)) == set(want)
    table = cluster.kubectl(*readme_kubectl("kubectl get inferencedeployments"), "-n", namespace).stdout.splitlines()
    assert table[0].split() == ["NAME", "MODEL", "PREFILL", "DECODE", "CACHE", "ROUTER", "READY", "AGE"]
    row = table[1].split()
    assert row[:7] == [name, spec["model"]["name"], *want.values(), "True"]
    # Applying the same file again is a no-op, as a user re-running the README expects.
    again = cluster.kubectl(*apply, "-n", namespace, cwd=ROOT).stdout
    assert "unchanged" in again


def test_the_readmes_table_is_what_kubectl_prints():
    """The README's example output has the CRD's printer columns (the test above checks kubectl's)."""
    shown = readme_block("text", "NAME ").splitlines()
    assert shown[0].split() == ["NAME", "MODEL", "PREFILL", "DECODE", "CACHE", "ROUTER", "READY", "AGE"]
    doc = sample()
    spec = doc["spec"]
    assert shown[1].split()[:7] == [doc["metadata"]["name"], spec["model"]["name"],
                                    *(f"{spec[c]['replicas']}/{spec[c]['replicas']}"
                                      for c in ("prefill", "decode", "cache", "router")), "True"]
