"""Fast unit tests of the local control plane harness (no cluster, no Go)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from .helpers import ROOT

sys.path.insert(0, str(ROOT / "e2e"))

from localcluster import nodes, procs  # noqa: E402
from localcluster.cluster import env_lines  # noqa: E402


def test_gpu_and_cpu_pools():
    made = nodes.cluster_nodes(2, 3)
    gpu = [n for n in made if n["metadata"]["labels"]["kvmesh.io/pool"] == "gpu"]
    cpu = [n for n in made if n["metadata"]["labels"]["kvmesh.io/pool"] == "cpu"]
    assert len(gpu) == 2 and len(cpu) == 3
    for n in gpu:
        assert n["status"]["allocatable"]["nvidia.com/gpu"] == "8"
        assert n["spec"]["taints"] == [nodes.GPU_TAINT]
        assert n["metadata"]["labels"]["nvidia.com/gpu.present"] == "true"
    for n in cpu:
        assert "nvidia.com/gpu" not in n["status"]["capacity"] and "taints" not in n["spec"]
    assert all(n["metadata"]["annotations"] == nodes.KWOK_ANNOTATION for n in made)
    assert len({n["metadata"]["name"] for n in made}) == 5


def test_node_readiness():
    assert nodes.is_ready({"status": {"conditions": [{"type": "Ready", "status": "True"}]}})
    assert not nodes.is_ready({"status": {"conditions": [{"type": "Ready", "status": "False"}]}})
    assert not nodes.is_ready({})


def test_processes_are_stopped_by_recorded_pid(tmp_path):
    a = procs.start(tmp_path, "sleeper", ["sleep", "60"])
    b = procs.start(tmp_path, "stubborn", [sys.executable, "-c",
                                           "import signal,time\n"
                                           "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                                           "print('up', flush=True)\ntime.sleep(60)"])
    deadline = time.monotonic() + 10
    while "up" not in (tmp_path / "logs" / "stubborn.log").read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert procs.check_running(tmp_path) == []
    killed = procs.stop_all(tmp_path, grace_s=0.5)
    assert killed == ["stubborn"]  # ignored SIGTERM, so it needed SIGKILL
    # SIGKILL is sent, not awaited: under load the kernel may take a moment to end the process.
    assert a.wait(timeout=10) is not None and b.wait(timeout=10) is not None
    assert set(procs.check_running(tmp_path)) == {"sleeper", "stubborn"}


def test_a_reused_pid_is_never_signalled(tmp_path):
    other = subprocess.Popen(["sleep", "60"])
    try:
        # A record whose pid now belongs to a process started at another time.
        (tmp_path / "pids.json").write_text(json.dumps(
            [{"name": "ghost", "pid": other.pid, "start": 1, "argv": ["x"]}]))
        assert procs.stop_all(tmp_path, grace_s=0.1) == []
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_env_lines(tmp_path):
    (tmp_path / "cluster.json").write_text(json.dumps(
        {"kubeconfig": "/x/kubeconfig", "bin": {"helm": "/c/helm", "kwok": "/c/kwok"}}))
    assert env_lines(tmp_path) == ["export KUBECONFIG=/x/kubeconfig",
                                   "export PATH=/c/helm:/c/kwok:$PATH"]


@pytest.mark.parametrize("component", ["kubernetes", "etcd", "kwok", "helm", "kubelet", "epp"])
def test_binaries_are_cached_outside_the_repo_by_version(component, tmp_path):
    out = subprocess.run([str(ROOT / "e2e" / "build-binaries"), "--print-dirs", component],
                         capture_output=True, text=True, check=True,
                         env={"KVMESH_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}).stdout
    name, path = out.strip().split("=", 1)
    versions = dict(line.split("=", 1) for line in (ROOT / "e2e" / "versions.env").read_text()
                    .splitlines() if line and not line.startswith("#"))
    key = {"kubernetes": "KUBERNETES_VERSION", "etcd": "ETCD_VERSION", "kwok": "KWOK_VERSION",
           "helm": "HELM_VERSION", "kubelet": "KUBERNETES_VERSION", "epp": "GIE_VERSION"}[component]
    assert name == component and path == f"{tmp_path}/{component}/{versions[key]}"


def test_missing_go_is_reported_clearly(tmp_path):
    result = subprocess.run([str(ROOT / "e2e" / "build-binaries"), "etcd"],
                            capture_output=True, text=True,
                            env={"KVMESH_CACHE_DIR": str(tmp_path), "PATH": "/nonexistent:/bin"})
    assert result.returncode == 3
    assert "Go toolchain is not installed" in result.stderr
