"""The kind path, checked as far as this machine allows (kind itself cannot run here: its node
image comes from a registry, its node containers need --privileged).

Real here: the suite's choice of cluster (a pure function of the environment), e2e/kind/up run
as a user without kind would run it, the kind config's nodes against the placement the operator
renders and the real-pod tests select, the taint the script puts on GPU workers against the
tolerations the operator renders. No cluster is touched.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import yaml

from kvmesh.operator import render as r

from .helpers import CPU_POOL_PLACEMENT, EXTERNAL_KUBECONFIG, ROOT, external_kubeconfig

KIND = ROOT / "e2e" / "kind"


def test_only_the_explicit_variable_selects_an_existing_cluster(tmp_path):
    config = tmp_path / "kubeconfig"
    config.write_text("apiVersion: v1\nkind: Config\n")
    assert external_kubeconfig({}) is None
    assert external_kubeconfig({"KUBECONFIG": str(config)}) is None  # the user's cluster: untouched
    assert external_kubeconfig({EXTERNAL_KUBECONFIG: str(config)}) == config
    with pytest.raises(FileNotFoundError, match=EXTERNAL_KUBECONFIG):
        external_kubeconfig({EXTERNAL_KUBECONFIG: str(tmp_path / "missing")})


@pytest.mark.parametrize("script", ["up", "down"])
def test_scripts_parse(script):
    subprocess.run(["bash", "-n", str(KIND / script)], check=True)


def test_up_names_the_missing_tool_before_touching_anything(tmp_path):
    # A PATH with bash and coreutils but no kind: the script must stop at its tool check.
    path = ":".join(d for d in ("/usr/bin", "/bin") if not os.path.exists(f"{d}/kind"))
    out = subprocess.run([str(KIND / "up")], env={"PATH": path, "HOME": str(tmp_path)},
                         capture_output=True, text=True)
    assert out.returncode == 3, out.stderr
    assert "needs kind on PATH" in out.stderr
    assert not (tmp_path / ".kube").exists()


def _kind_nodes() -> list[dict]:
    config = yaml.safe_load((KIND / "kind-config.yaml").read_text())
    assert config["kind"] == "Cluster" and config["apiVersion"] == "kind.x-k8s.io/v1alpha4"
    return config["nodes"]


def test_kind_has_the_pools_the_suite_places_pods_on():
    workers = [n.get("labels", {}) for n in _kind_nodes() if n["role"] == "worker"]
    selector = CPU_POOL_PLACEMENT["nodeSelector"]
    cpu = [w for w in workers if all(w.get(k) == v for k, v in selector.items())]
    gpu = [w for w in workers if w.get("nvidia.com/gpu.present") == "true"]
    assert cpu and gpu, workers
    assert not [w for w in cpu if w in gpu]


def test_gpu_pods_tolerate_the_taint_up_puts_on_gpu_workers():
    (taint,) = re.findall(r'kubectl taint "\$node" (\S+)', (KIND / "up").read_text())
    key, rest = taint.split("=", 1)
    value, effect = rest.split(":")
    cr = {"apiVersion": "serving.kvmesh.io/v1alpha1", "kind": "InferenceDeployment",
          "metadata": {"name": "x", "namespace": "ns", "uid": "u"},
          "spec": {"model": {"name": "m"}, "prefill": {"replicas": 1}}}
    deployments = {o["metadata"]["labels"]["app.kubernetes.io/component"]: o
                   for o in r.render_all(cr) if o["kind"] == "Deployment"}
    for component in ("prefill", "decode"):
        pod = deployments[component]["spec"]["template"]["spec"]
        assert any(t["key"] == key and t.get("effect") in (None, effect) and (
            t.get("operator") == "Exists" or t.get("value") == value) for t in pod["tolerations"]), (
            component, pod["tolerations"], taint)


def test_kind_node_image_follows_the_pinned_kubernetes_version():
    versions = dict(line.split("=", 1) for line in (ROOT / "e2e" / "versions.env").read_text().split()
                    if "=" in line and not line.startswith("#"))
    assert re.fullmatch(r"v\d+\.\d+\.\d+", versions["KUBERNETES_VERSION"])
    assert "kindest/node:$KUBERNETES_VERSION" in (KIND / "up").read_text()
