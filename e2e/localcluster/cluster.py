"""`up` and `down` for the local control plane.

up DIR:   build (or reuse) the pinned binaries, make the PKI, start etcd,
          kube-apiserver (TLS, RBAC), kube-controller-manager,
          kube-scheduler and kwok on 127.0.0.1 with free ports, write
          DIR/kubeconfig, create the fake GPU and CPU nodes, and return once
          every node is Ready. With real_node, also one real kubelet node
          (node_runtime.py: containerd, CNI bridge, cluster DNS).
down DIR: stop every process `up` started (by recorded pid) and remove DIR.

All state lives in DIR: certificates in DIR/pki, logs in DIR/logs, etcd data
in DIR/etcd, pids in DIR/pids.json, ports and binary paths in DIR/cluster.json.
"""

from __future__ import annotations

import base64
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from . import node_runtime, nodes, procs
from .api import Api, ApiError, probe_http, probe_https
from .pki import Pki, make_pki

E2E_DIR = Path(__file__).resolve().parent.parent
SERVICE_CIDR = "10.96.0.0/16"
POD_CIDR = "10.244.0.1/16"  # kwok hands out pod IPs from here: not loopback, not services


class ClusterError(RuntimeError):
    """The control plane did not come up; the message points at the log to read."""


def log(msg: str) -> None:
    print(f"[cluster {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port(taken: set[int] | None = None) -> int:
    """A free port below the kernel's ephemeral range (where no outbound connection can take it
    before the component binds it), not in ``taken``; adds it to ``taken``. This tool runs on
    the system Python, apart from the kvmesh package and its port helpers."""
    try:
        high = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        high = 32768
    taken = set() if taken is None else taken
    for _ in range(500):
        port = random.SystemRandom().randrange(10000, high)
        if port in taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        taken.add(port)
        return port
    raise ClusterError("no free port below the ephemeral range")


DEFAULT_COMPONENTS = ("kubernetes", "etcd", "kwok", "helm")


def binary_dirs(build: bool, components: tuple[str, ...] = DEFAULT_COMPONENTS) -> dict[str, Path]:
    """Component -> directory holding its binaries; builds missing ones first."""
    script = E2E_DIR / "build-binaries"
    if build:
        result = subprocess.run([str(script), *components])
        if result.returncode != 0:
            raise ClusterError(f"building the binaries failed (exit {result.returncode}); "
                               "see the output above")
    out = subprocess.run([str(script), "--print-dirs", *components], capture_output=True, text=True,
                         check=True).stdout
    dirs = {k: Path(v) for k, v in (line.split("=", 1) for line in out.split())}
    missing = [k for k, d in dirs.items() if not (d / ".complete").exists()]
    if missing:
        raise ClusterError(f"binaries not built for {', '.join(missing)}; "
                           f"run {script} (or `e2e/cluster up` without --no-build)")
    return dirs


def wait_for(what: str, check: Callable[[], bool], timeout_s: float, log_file: Path | None,
             state_dir: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        dead = procs.check_running(state_dir)
        if dead:
            raise ClusterError(f"{', '.join(dead)} exited while waiting for {what}; "
                               f"see {state_dir / 'logs'}")
        time.sleep(0.25)
    hint = f"; see {log_file}" if log_file else ""
    raise ClusterError(f"timed out after {timeout_s:.0f}s waiting for {what}{hint}")


def write_kubeconfig(path: Path, server: str, pki: Pki) -> None:
    def b64(p: Path) -> str:
        return base64.b64encode(p.read_bytes()).decode()

    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kvmesh-local", "cluster": {
            "server": server, "certificate-authority-data": b64(pki.ca_crt)}}],
        "users": [{"name": "kvmesh-admin", "user": {
            "client-certificate-data": b64(pki.admin_crt), "client-key-data": b64(pki.admin_key)}}],
        "contexts": [{"name": "kvmesh-local", "context": {
            "cluster": "kvmesh-local", "user": "kvmesh-admin", "namespace": "default"}}],
        "current-context": "kvmesh-local",
    }
    path.write_text(json.dumps(cfg, indent=1))  # JSON is YAML: every client reads it
    path.chmod(0o600)


def up(state_dir: Path, gpu_nodes: int = 2, cpu_nodes: int = 2, build: bool = True,
       timeout_s: float = 120, real_node: bool = False) -> Path:
    started = time.monotonic()
    if (state_dir / "pids.json").exists():
        raise ClusterError(f"{state_dir} already holds a cluster; run `e2e/cluster down "
                           f"{state_dir}` first")
    if real_node:
        node_runtime.check_prerequisites()
    bins = binary_dirs(build, DEFAULT_COMPONENTS + (("kubelet",) if real_node else ()))
    k8s, logs = bins["kubernetes"], state_dir / "logs"
    state_dir.mkdir(parents=True, exist_ok=True)
    pki = make_pki(state_dir / "pki")
    taken: set[int] = set()
    ports = {k: free_port(taken) for k in ("etcd", "etcd_peer", "apiserver", "kcm", "scheduler",
                                           "kwok")}
    server = f"https://127.0.0.1:{ports['apiserver']}"
    kubeconfig = state_dir / "kubeconfig"
    (state_dir / "cluster.json").write_text(json.dumps(
        {"server": server, "ports": ports, "kubeconfig": str(kubeconfig),
         "bin": {k: str(v) for k, v in bins.items()}}, indent=1))
    try:
        etcd_url = f"http://127.0.0.1:{ports['etcd']}"
        peer_url = f"http://127.0.0.1:{ports['etcd_peer']}"
        procs.start(state_dir, "etcd", [
            str(bins["etcd"] / "etcd"), "--name=kvmesh", f"--data-dir={state_dir / 'etcd'}",
            f"--listen-client-urls={etcd_url}", f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=kvmesh={peer_url}", "--unsafe-no-fsync",
            "--log-level=warn",
        ])
        wait_for("etcd", lambda: probe_http(f"{etcd_url}/health"), 30, logs / "etcd.log",
                 state_dir)
        procs.start(state_dir, "kube-apiserver", [
            str(k8s / "kube-apiserver"), f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
            f"--secure-port={ports['apiserver']}", f"--cert-dir={pki.dir}",
            f"--tls-cert-file={pki.server_crt}", f"--tls-private-key-file={pki.server_key}",
            f"--client-ca-file={pki.ca_crt}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki.sa_pub}",
            f"--service-account-signing-key-file={pki.sa_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--authorization-mode=RBAC", "--allow-privileged=true",
            # logs, exec and port-forward reach the real node's kubelet on its IP.
            f"--kubelet-client-certificate={pki.admin_crt}",
            f"--kubelet-client-key={pki.admin_key}",
            "--kubelet-preferred-address-types=InternalIP,Hostname",
            "--profiling=false", "--v=1",
        ])
        api = Api(server, str(pki.ca_crt), str(pki.admin_crt), str(pki.admin_key))

        def api_ready() -> bool:
            try:
                return api.get("/readyz") == "ok"
            except (ApiError, OSError):
                return False

        wait_for("kube-apiserver /readyz", api_ready, 60, logs / "kube-apiserver.log", state_dir)
        write_kubeconfig(kubeconfig, server, pki)
        procs.start(state_dir, "kube-controller-manager", [
            str(k8s / "kube-controller-manager"), f"--kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1", f"--secure-port={ports['kcm']}",
            "--leader-elect=false", f"--service-account-private-key-file={pki.sa_key}",
            f"--root-ca-file={pki.ca_crt}", "--use-service-account-credentials=false",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--allocate-node-cidrs=false",
            "--profiling=false", "--v=1",
        ])
        procs.start(state_dir, "kube-scheduler", [
            str(k8s / "kube-scheduler"), f"--kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1", f"--secure-port={ports['scheduler']}",
            "--leader-elect=false", "--profiling=false", "--v=1",
        ])
        procs.start(state_dir, "kwok", [
            str(bins["kwok"] / "kwok"), f"--kubeconfig={kubeconfig}",
            "--manage-all-nodes=false",
            "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
            f"--cidr={POD_CIDR}", "--node-ip=10.244.255.254",
            # Heartbeats through kube-node-lease Leases (renewed every ~10s):
            # without them the node lifecycle controller marks the nodes, and
            # then their pods, NotReady after its 50s grace period.
            "--node-lease-duration-seconds=40",
            f"--server-address=127.0.0.1:{ports['kwok']}",
        ])
        wait_for("kube-controller-manager /healthz",
                 lambda: probe_https(f"https://127.0.0.1:{ports['kcm']}/healthz"), 60,
                 logs / "kube-controller-manager.log", state_dir)
        wait_for("kube-scheduler /healthz",
                 lambda: probe_https(f"https://127.0.0.1:{ports['scheduler']}/healthz"), 60,
                 logs / "kube-scheduler.log", state_dir)
        for n in nodes.cluster_nodes(gpu_nodes, cpu_nodes):
            api.create("/api/v1/nodes", n)
        names = [n["metadata"]["name"] for n in nodes.cluster_nodes(gpu_nodes, cpu_nodes)]
        if real_node:
            names.append(node_runtime.start(
                state_dir, bins["kubelet"] / "kubelet", kubeconfig, pki.ca_crt, lambda: free_port(taken),
                _cache_dir(), lambda what, check, t, log_file: wait_for(
                    what, check, t, log_file, state_dir)))

        def nodes_ready() -> bool:
            items = api.get("/api/v1/nodes").get("items", [])
            ready = {i["metadata"]["name"] for i in items if nodes.is_ready(i)}
            return all(n in ready for n in names)

        wait_for(f"nodes {', '.join(names)} Ready", nodes_ready, timeout_s, logs / "kwok.log",
                 state_dir)
        # Pods need the namespace's default ServiceAccount, which the
        # controller-manager creates shortly after it starts.
        wait_for("default/default ServiceAccount",
                 lambda: _exists(api, "/api/v1/namespaces/default/serviceaccounts/default"),
                 60, logs / "kube-controller-manager.log", state_dir)
    except BaseException:
        log(f"start failed; stopping what was started (logs kept in {logs})")
        node_runtime.stop(state_dir, api_from_state(state_dir))
        procs.stop_all(state_dir)
        raise
    log(f"cluster up in {time.monotonic() - started:.1f}s: export KUBECONFIG={kubeconfig}")
    return kubeconfig


def _exists(api: Api, path: str) -> bool:
    try:
        api.get(path)
        return True
    except ApiError:
        return False


def down(state_dir: Path) -> None:
    if not state_dir.exists():
        log(f"{state_dir} does not exist; nothing to stop")
        return
    node_runtime.stop(state_dir, api_from_state(state_dir))
    killed = procs.stop_all(state_dir)
    if killed:
        log(f"had to SIGKILL: {', '.join(killed)}")
    shutil.rmtree(state_dir, ignore_errors=True)
    log(f"cluster in {state_dir} stopped and removed")


def _cache_dir() -> Path:
    env = os.environ.get("KVMESH_CACHE_DIR")
    return Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvmesh"


def api_from_state(state_dir: Path) -> Api | None:
    """An admin client for the cluster in DIR, or None before the API server was set up."""
    try:
        info = json.loads((state_dir / "cluster.json").read_text())
    except (OSError, ValueError):
        return None
    pki = Pki(state_dir / "pki")
    if not pki.admin_crt.exists():
        return None
    return Api(info["server"], str(pki.ca_crt), str(pki.admin_crt), str(pki.admin_key))


def env_lines(state_dir: Path) -> list[str]:
    info = json.loads((state_dir / "cluster.json").read_text())
    path = os.pathsep.join(info["bin"].values())
    return [f"export KUBECONFIG={info['kubeconfig']}", f"export PATH={path}:$PATH"]
