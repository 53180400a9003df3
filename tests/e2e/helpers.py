"""Helpers for tests against a real API server (no mocks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from kvmesh.engine.util.localproc import free_port

ROOT = Path(__file__).resolve().parents[2]
GROUP, VERSION, PLURAL = "serving.kvmesh.io", "v1alpha1", "inferencedeployments"
# The engine image the tests put in their specs. On the local control plane no
# container runs, so any name works; on kind it must be loaded into the nodes.
IMAGE = os.environ.get("KVMESH_E2E_IMAGE", "kvmesh/kvmesh:0.1.0")


# Where real pods go on a cluster without the local real node: kind's CPU workers (e2e/kind).
CPU_POOL_PLACEMENT = {"nodeSelector": {"kvmesh.io/pool": "cpu"}}
EXTERNAL_KUBECONFIG = "KVMESH_E2E_KUBECONFIG"


def external_kubeconfig(env: dict[str, str]) -> Path | None:
    """The cluster the suite was explicitly told to use, or None: start a local one.

    Only KVMESH_E2E_KUBECONFIG selects an existing cluster. A KUBECONFIG in the environment does
    not: it may well point at a cluster someone depends on, and the suite creates namespaces,
    CRDs and a Helm release wherever it runs."""
    raw = env.get(EXTERNAL_KUBECONFIG, "").strip()
    if not raw:
        return None
    path = Path(raw).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{EXTERNAL_KUBECONFIG}={raw}: no such kubeconfig file")
    return path


def wait_until(what: str, check: Callable[[], Any], timeout: float = 60, every: float = 0.3):
    """Poll `check` until it returns something truthy; fail with `what` and the last value."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except ApiException as exc:
            last = f"ApiException {exc.status}: {exc.reason}"
        else:
            if last:
                return last
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


@dataclass
class Cluster:
    kubeconfig: Path
    bin_dirs: list[Path]
    local: bool  # started by the fixture (kwok nodes) rather than $KUBECONFIG
    api: client.ApiClient = field(init=False)

    @property
    def state_dir(self) -> Path:
        """The local cluster's state directory (e2e/cluster up DIR)."""
        return self.kubeconfig.parent

    @property
    def real_node(self) -> bool:
        """The local cluster was started with a real kubelet node (--real-node)."""
        info = self.state_dir / "cluster.json"
        return self.local and info.exists() and bool(json.loads(info.read_text()).get("real_node"))

    def __post_init__(self) -> None:
        self.api = config.new_client_from_config(config_file=str(self.kubeconfig))

    @property
    def env(self) -> dict[str, str]:
        path = os.pathsep.join(str(d) for d in self.bin_dirs)
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig),
                "PATH": f"{path}{os.pathsep}{os.environ.get('PATH', '')}"}

    def run(self, *argv: str, check: bool = True, env: dict | None = None,
            timeout: float = 120, cwd: Path | None = None) -> subprocess.CompletedProcess:
        result = subprocess.run(list(argv), env=env or self.env, capture_output=True, text=True,
                                timeout=timeout, cwd=cwd)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} failed ({result.returncode}):\n"
                                 f"{result.stdout}\n{result.stderr}")
        return result

    def kubectl(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return self.run("kubectl", *args, **kw)

    def wait_crds_established(self, *names: str, timeout: float = 60) -> None:
        """Each named CRD has condition Established=True. Polled rather than `kubectl wait`:
        kubectl's condition wait fails outright ("<nil> is of the type <nil>") on a CRD the
        apiserver has stored but not yet given any status conditions."""
        jsonpath = '{.status.conditions[?(@.type=="Established")].status}'
        for name in names:
            wait_until(f"crd/{name} Established", lambda: self.kubectl(
                "get", f"crd/{name}", "-o", f"jsonpath={jsonpath}",
                check=False).stdout.strip() == "True", timeout=timeout)

    def helm(self, *args: str, home: Path, **kw) -> subprocess.CompletedProcess:
        env = {**self.env, "HELM_CACHE_HOME": str(home / "cache"),
               "HELM_CONFIG_HOME": str(home / "config"), "HELM_DATA_HOME": str(home / "data")}
        return self.run("helm", *args, env=env, **kw)

    @property
    def apps(self) -> client.AppsV1Api:
        return client.AppsV1Api(self.api)

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api)

    @property
    def custom(self) -> client.CustomObjectsApi:
        return client.CustomObjectsApi(self.api)

    def create_namespace(self, name: str, labels: dict[str, str] | None = None) -> str:
        try:
            self.core.create_namespace({"metadata": {"name": name, "labels": dict(labels or {})}})
        except ApiException as exc:
            if exc.status != 409:
                raise
        return name

    def delete_namespace(self, name: str) -> None:
        try:
            self.core.delete_namespace(name)
        except ApiException as exc:
            if exc.status != 404:
                raise

    def get_custom(self, group: str, version: str, plural: str, ns: str, name: str) -> dict | None:
        """A namespaced custom object, or None when it does not exist."""
        try:
            return self.custom.get_namespaced_custom_object(group, version, ns, plural, name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def get_cr(self, ns: str, name: str) -> dict | None:
        return self.get_custom(GROUP, VERSION, PLURAL, ns, name)

    def create_cr(self, ns: str, name: str, spec: dict) -> dict:
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment",
                "metadata": {"name": name}, "spec": spec}
        return self.custom.create_namespaced_custom_object(
            GROUP, VERSION, ns, PLURAL, body, field_validation="Strict")

    def patch_cr(self, ns: str, name: str, patch: dict) -> dict:
        return self.custom.patch_namespaced_custom_object(
            GROUP, VERSION, ns, PLURAL, name, patch, _content_type="application/merge-patch+json")

    def deployments(self, ns: str, owner: str) -> dict[str, Any]:
        items = self.apps.list_namespaced_deployment(
            ns, label_selector=f"serving.kvmesh.io/inference-deployment={owner}").items
        return {d.metadata.labels["app.kubernetes.io/component"]: d for d in items}


def condition(obj: dict | None, ctype: str) -> dict:
    for c in ((obj or {}).get("status") or {}).get("conditions") or ():
        if c["type"] == ctype:
            return c
    return {}


@dataclass
class OperatorProcess:
    """`python -m kvmesh.operator` as a child process, stopped by its pid."""

    proc: subprocess.Popen
    log: Path
    health_port: int
    kubeconfig: Path
    args: tuple[str, ...]

    @classmethod
    def start(cls, kubeconfig: Path, log: Path, *args: str) -> OperatorProcess:
        proc, port = cls._spawn(kubeconfig, log, args)
        op = cls(proc, log, port, kubeconfig, args)
        op._await_health()
        return op

    @staticmethod
    def _spawn(kubeconfig: Path, log: Path, args: tuple[str, ...]) -> tuple[subprocess.Popen, int]:
        port = free_port()
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1"}
        out = open(log, "ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvmesh.operator", "--health-port", str(port),
             "--health-host", "127.0.0.1", *args],
            stdout=out, stderr=subprocess.STDOUT, env=env)
        out.close()
        return proc, port

    def _await_health(self) -> None:
        wait_until("operator health endpoint", lambda: self.probe("/healthz") == 200 or
                   self.exited(), timeout=60)
        assert not self.exited(), self.tail()

    def restart(self, sig_kill: bool = False) -> None:
        """Stop this operator (SIGKILL: as if its node died, nothing cleaned up) and start another
        with the same arguments in its place; it leads once the old one's lease runs out."""
        self.stop(sig_kill=sig_kill)
        self.proc, self.health_port = self._spawn(self.kubeconfig, self.log, self.args)
        self._await_health()

    def exited(self) -> bool:
        return self.proc.poll() is not None

    def probe(self, path: str) -> int | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}{path}",
                                        timeout=2) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return None

    def is_leader(self) -> bool:
        return self.probe("/leader") == 200

    def tail(self, n: int = 60) -> str:
        lines = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        return "\n".join(lines[-n:])

    def stop(self, sig_kill: bool = False) -> None:
        if self.exited():
            return
        if sig_kill:
            self.proc.kill()
        else:
            self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=1, default=str)[:4000]
