"""Start and stop the real node: bridge, containerd, pause image, cluster DNS, kubelet.

Needs root and Debian's containerd, runc, containernetworking-plugins,
iptables and iproute2 (scripts/setup-e2e-node installs them). Every resource
is named in DIR/cluster.json under "real_node" so `down` removes exactly what
`up` made: the pods' containers (through the kubelet when it can, else
killed), the mounts under DIR, the bridge and the cgroup subtree. Only images
outlive it: containerd's root is the machine's image store (image_store.py)
when no other node uses it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from . import image_store, pause, procs, realnode
from .api import Api, ApiError

NEEDED = {"containerd": "containerd", "containerd-shim-runc-v2": "containerd", "runc": "runc",
          "ctr": "containerd", "iptables": "iptables", "ip": "iproute2"}


class NodeError(RuntimeError):
    """The real node could not be set up; the message says what to install or read."""


def _run(*argv: str, check: bool = True, input: bytes | None = None,
         timeout: float = 600) -> subprocess.CompletedProcess:
    result = subprocess.run(list(argv), capture_output=True, input=input, timeout=timeout)
    if check and result.returncode != 0:
        raise NodeError(f"{' '.join(argv[:6])} failed ({result.returncode}): "
                        f"{result.stderr.decode(errors='replace').strip()[-800:]}")
    return result


def check_prerequisites() -> None:
    if os.geteuid() != 0:
        raise NodeError("the real node needs root (it runs containerd and the kubelet)")
    missing = sorted({pkg for tool, pkg in NEEDED.items() if shutil.which(tool) is None})
    if not Path(realnode.CNI_BIN_DIR, "bridge").exists():
        missing.append("containernetworking-plugins")
    if missing:
        raise NodeError(f"missing Debian packages for the real node: {' '.join(missing)}; "
                        "run scripts/setup-e2e-node")


def ctr(info: dict[str, Any], *args: str, **kw) -> subprocess.CompletedProcess:
    return _run("ctr", "--address", info["socket"], "--namespace", "k8s.io", *args, **kw)


def import_image(state_dir: Path, data: bytes) -> None:
    """`ctr images import` an image archive piped in."""
    ctr(load(state_dir), "images", "import", "-", input=data)


def import_pause(state_dir: Path, cache_dir: Path) -> None:
    """(Re)import the sandbox image. containerd 1.6 does not pin it, so the kubelet's
    image garbage collection may remove it under disk pressure; every load-image
    puts it back."""
    import_image(state_dir, data=pause.image_archive(pause.build_binary(cache_dir).read_bytes()))


def load(state_dir: Path) -> dict[str, Any]:
    return json.loads((state_dir / "cluster.json").read_text()).get("real_node") or {}


def _save(state_dir: Path, info: dict[str, Any]) -> None:
    path = state_dir / "cluster.json"
    cluster = json.loads(path.read_text())
    cluster["real_node"] = info
    path.write_text(json.dumps(cluster, indent=1))


def start(state_dir: Path, kubelet_bin: Path, kubeconfig: Path, ca_file: Path,
          free_port: Callable[[], int], cache_dir: Path,
          wait: Callable[[str, Callable[[], bool], float, Path | None], None]) -> str:
    """Bring the node up (its Ready condition is waited for by the caller); returns its name."""
    check_prerequisites()
    node = state_dir / "node"
    routes = _run("ip", "-4", "route").stdout.decode().splitlines()
    net = realnode.choose_net(routes)
    cgroup_root = f"/kvmesh-{net.index}"
    info = {"name": realnode.NODE_NAME, "index": net.index, "bridge": net.bridge,
            "gateway": net.gateway, "cgroup_root": cgroup_root,
            "socket": str(node / "containerd" / "containerd.sock"), "dir": str(node)}
    _save(state_dir, info)  # before making anything, so `down` can undo a partial start
    # The bridge exists before the first pod so the DNS server can bind its address;
    # the CNI bridge plugin adopts it.
    _run("ip", "link", "add", net.bridge, "type", "bridge")
    _run("ip", "addr", "add", f"{net.gateway}/{net.subnet.prefixlen}", "dev", net.bridge)
    _run("ip", "link", "set", net.bridge, "up")
    mounts = Path("/proc/mounts").read_text()
    for d in realnode.cgroup_root_dirs(mounts, cgroup_root):
        d.mkdir(parents=True, exist_ok=True)
    conf_dir = node / "cni" / "net.d"
    conf_dir.mkdir(parents=True)
    (conf_dir / "10-kvmesh.conflist").write_text(json.dumps(
        realnode.cni_conflist(net, node / "cni" / "ipam"), indent=1))
    cd_dir = node / "containerd"
    cd_dir.mkdir(parents=True, exist_ok=True)
    logs = state_dir / "logs"

    def start_containerd() -> None:
        procs.start(state_dir, "containerd", ["containerd", "--config", str(cd_dir / "config.toml")])
        wait("containerd", lambda: ctr(info, "version", check=False).returncode == 0, 30,
             logs / "containerd.log")

    with image_store.claim(cache_dir) as store:
        info["image_store"] = str(store) if store else None
        _save(state_dir, info)
        (cd_dir / "config.toml").write_text(realnode.containerd_config(
            cd_dir, pause.IMAGE, shutil.which("runc") or "runc", conf_dir, root=store))
        start_containerd()
        if store:
            image_store.own(store, procs.newest(state_dir, "containerd"))
            # Containers a killed cluster left behind: containerd's CRI would hand them to the
            # new kubelet as its own pods' sandboxes, so they go, and containerd starts afresh.
            if _remove_containers(info):
                procs.stop_named(state_dir, {"containerd"})
                start_containerd()
                image_store.own(store, procs.newest(state_dir, "containerd"))
    import_pause(state_dir, cache_dir)
    procs.start(state_dir, "cluster-dns", [sys.executable, str(Path(__file__).parents[1] / "cluster"),
                                           "serve-dns", str(state_dir)])
    port, healthz = free_port(), free_port()
    kdir = node / "kubelet"
    kdir.mkdir(parents=True)
    cfg = realnode.kubelet_config(net, socket=Path(info["socket"]), ca_file=ca_file, port=port,
                                  healthz_port=healthz, cgroup_root=cgroup_root)
    (node / "kubelet.json").write_text(json.dumps(cfg, indent=1))
    procs.start(state_dir, "kubelet", realnode.kubelet_args(
        kubelet_bin, config=node / "kubelet.json", kubeconfig=kubeconfig, root_dir=kdir, net=net))
    return info["name"]


def _drain(api: Api | None, info: dict[str, Any], timeout_s: float = 30) -> None:
    """Delete the node's pods so the kubelet stops them (and CNI releases their
    addresses and firewall rules), then wait for containerd to have no tasks."""
    if api is not None:
        try:
            pods = api.get(f"/api/v1/pods?fieldSelector=spec.nodeName={info['name']}")
            for p in pods.get("items", []):
                m = p["metadata"]
                api.request("DELETE", f"/api/v1/namespaces/{m['namespace']}/pods/{m['name']}",
                            {"gracePeriodSeconds": 0})
        except (ApiError, OSError):
            return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        tasks = ctr(info, "tasks", "ls", "-q", check=False)
        if tasks.returncode != 0 or not tasks.stdout.strip():
            return
        time.sleep(0.5)


def _kill_tasks(info: dict[str, Any]) -> None:
    """Whatever the kubelet did not stop: kill and delete the tasks. Their network
    namespaces are mounted under DIR (containerd's netns_mounts_under_state_dir)
    and go with the other mounts there."""
    listing = ctr(info, "tasks", "ls", "-q", check=False)
    tasks = listing.stdout.decode().split() if listing.returncode == 0 else []
    for task in tasks:
        ctr(info, "tasks", "kill", "--signal", "SIGKILL", task, check=False)
    for task in tasks:
        for _ in range(20):
            if ctr(info, "tasks", "delete", "--force", task, check=False).returncode == 0:
                break
            time.sleep(0.25)


def _remove_containers(info: dict[str, Any]) -> int:
    """Delete every container (pods' and their sandboxes'; their tasks are gone) from the node's
    containerd, so a persistent image store keeps images only. Returns how many there were."""
    listing = ctr(info, "containers", "ls", "-q", check=False)
    names = listing.stdout.decode().split() if listing.returncode == 0 else []
    if names:
        ctr(info, "containers", "rm", *names, check=False)
    return len(names)


def stop(state_dir: Path, api: Api | None) -> None:
    """Undo `start` (safe on a partial start); the caller then stops the other processes."""
    if not (state_dir / "cluster.json").exists():
        return
    info = load(state_dir)
    if not info:
        return
    if Path(info["socket"]).exists():
        _drain(api, info)
        procs.stop_named(state_dir, {"kubelet", "cluster-dns"})
        _kill_tasks(info)
        if info.get("image_store"):
            _remove_containers(info)
    procs.stop_named(state_dir, {"kubelet", "cluster-dns", "containerd"})
    mounts = Path("/proc/mounts").read_text()
    for point in realnode.mounts_under(mounts, state_dir):
        _run("umount", "-l", point, check=False)
    _run("ip", "link", "del", info["bridge"], check=False)
    for d in realnode.cgroup_root_dirs(Path("/proc/mounts").read_text(), info["cgroup_root"]):
        if not d.exists():
            continue
        # Deepest first: a cgroup directory can be removed once it has no children
        # and no processes (its control files go with it).
        for sub in sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            _rmdir(sub)
        _rmdir(d)


def _rmdir(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass


def load_docker_image(state_dir: Path, image: str, cache_dir: Path) -> None:
    """`docker save IMAGE | ctr images import -`: the node's only way to get images
    (no registry), so pods use imagePullPolicy IfNotPresent or Never."""
    info = load(state_dir)
    if not info:
        raise NodeError(f"the cluster in {state_dir} has no real node (start it with --real-node)")
    store = Path(info["image_store"]) if info.get("image_store") else None
    docker_id = _docker_image_id(image)
    if store is not None:
        if docker_id and image_store.imported(store, image) == docker_id and _has_image(info, image):
            import_pause(state_dir, cache_dir)
            return
        image_store.set_imported(store, image, None)
    save = subprocess.Popen(["docker", "save", image], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    imp = subprocess.run(["ctr", "--address", info["socket"], "--namespace", "k8s.io", "images",
                          "import", "-"], stdin=save.stdout, capture_output=True)
    save.stdout.close()
    err = save.stderr.read().decode(errors="replace")
    if save.wait() != 0:
        raise NodeError(f"docker save {image} failed: {err.strip()[-500:]} "
                        "(build it with e2e/image/build)")
    if imp.returncode != 0:
        raise NodeError(f"ctr images import failed: {imp.stderr.decode(errors='replace')[-500:]}")
    if store is not None and docker_id:
        image_store.set_imported(store, image, docker_id)
    import_pause(state_dir, cache_dir)


def _docker_image_id(image: str) -> str | None:
    out = subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", image],
                         capture_output=True, text=True)
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def _has_image(info: dict[str, Any], image: str) -> bool:
    """The node's containerd has `image` by name (the kubelet's image GC may have removed it)."""
    listing = ctr(info, "images", "ls", "-q", check=False)
    return image_store.containerd_name(image) in listing.stdout.decode().split()
