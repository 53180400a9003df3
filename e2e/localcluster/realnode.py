"""Configuration of the one real node (pure functions, no I/O).

The real node is a kubelet on this machine with containerd (CRI plugin,
cgroupfs driver, runc) and CNI's bridge + host-local plugins. Everything it
owns is named from one short id so that several clusters can share a machine:
its bridge, its /24 of 10.245.0.0/16, its cgroup subtree, its containerd
socket and state. The bridge's address is also the node's IP (the kubelet
refuses loopback) and the address of the cluster DNS server (dns.py), which
pods can reach because it is their gateway.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

NODE_NAME = "kvmesh-real-0"
POD_NETWORK = ipaddress.ip_network("10.245.0.0/16")
# Pods land here only when they tolerate this taint and select the node: the
# e2e tests that run real containers say so; everything else stays on kwok.
TAINT = {"key": "kvmesh.io/real-node", "value": "true", "effect": "NoSchedule"}
LABELS = {"kvmesh.io/pool": "real", "kvmesh.io/real-node": "true"}
CLUSTER_DOMAIN = "cluster.local"
CNI_BIN_DIR = "/usr/lib/cni"  # Debian's containernetworking-plugins
# Controllers the kubelet and runc use on a cgroup v1 host; each needs the
# node's cgroup root to exist in its hierarchy.
CGROUP_V1_CONTROLLERS = ("cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "blkio",
                         "pids", "hugetlb", "net_cls", "net_prio", "perf_event", "systemd")


@dataclass(frozen=True)
class NodeNet:
    """The node's slice of the pod network."""

    index: int  # 0..255: the third octet of 10.245.N.0/24

    @property
    def subnet(self) -> ipaddress.IPv4Network:
        return ipaddress.ip_network(f"10.245.{self.index}.0/24")

    @property
    def gateway(self) -> str:
        return f"10.245.{self.index}.1"

    @property
    def bridge(self) -> str:
        return f"kvmesh{self.index}"  # interface names are at most 15 bytes


def choose_net(routes: Iterable[str]) -> NodeNet:
    """The first 10.245.N.0/24 no route on the machine overlaps (`ip -4 route` lines)."""
    used = set()
    for line in routes:
        dest = line.split(" ", 1)[0]
        try:
            net = ipaddress.ip_network(dest, strict=False)
        except ValueError:  # "default" and the like
            continue
        if net.version == 4 and net.overlaps(POD_NETWORK):
            used.add(net)
    for i in range(1, 256):
        candidate = NodeNet(i)
        if not any(candidate.subnet.overlaps(u) for u in used):
            return candidate
    raise ValueError("every 10.245.N.0/24 is in use on this machine; stop another local cluster")


def cni_conflist(net: NodeNet, ipam_dir: Path) -> dict[str, Any]:
    """bridge + host-local, then firewall: when a Docker daemon has set the FORWARD
    policy to DROP (and bridged frames go through iptables), the firewall plugin's
    per-pod ACCEPT rules keep pod-to-pod traffic flowing."""
    return {
        "cniVersion": "1.0.0",
        "name": f"kvmesh-{net.index}",
        "plugins": [
            {
                "type": "bridge",
                "bridge": net.bridge,
                "isGateway": True,
                "ipMasq": False,  # pods talk to pods and to the host only: no NAT rules
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": str(net.subnet), "gateway": net.gateway}]],
                    "dataDir": str(ipam_dir),
                },
            },
            {"type": "firewall", "backend": "iptables"},
        ],
    }


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def containerd_config(state: Path, pause_image: str, runc: str, cni_conf_dir: Path,
                      root: Path | None = None) -> str:
    """containerd 1.6 (config version 2) with its own root, state and socket, so it
    never meets the machine's other containerd (e.g. Docker's). `root` (images and their
    unpacked layers) defaults to `state`/root; the node passes a persistent image store."""
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    sections: list[tuple[str | None, dict[str, Any]]] = [
        (None, {
            "version": 2,
            "root": root or state / "root",
            "state": state / "state",
            # Plugins that would touch paths outside `state` or need absent kernels.
            "disabled_plugins": ["io.containerd.internal.v1.opt",
                                 "io.containerd.snapshotter.v1.aufs",
                                 "io.containerd.snapshotter.v1.btrfs",
                                 "io.containerd.snapshotter.v1.devmapper",
                                 "io.containerd.snapshotter.v1.zfs",
                                 "io.containerd.tracing.processor.v1.otlp"],
        }),
        ("grpc", {"address": state / "containerd.sock"}),
        ("ttrpc", {"address": state / "containerd.sock.ttrpc"}),
        (cri, {"sandbox_image": pause_image, "stream_server_address": "127.0.0.1",
               "stream_server_port": "0", "enable_selinux": False,
               # Pod network namespaces under `state` too, not the shared /run/netns.
               "netns_mounts_under_state_dir": True,
               # The kubelet asks for oom_score_adj -998 for pod sandboxes; lowering it
               # below 0 needs CAP_SYS_RESOURCE, which these VMs' bounding set lacks
               # (runc init then dies: "can't get final child's PID from pipe").
               # Clamp requests to containerd's own score instead.
               "restrict_oom_score_adj": True,
               "max_container_log_line_size": 16384}),
        (f"{cri}.containerd", {"snapshotter": "overlayfs", "default_runtime_name": "runc"}),
        (f"{cri}.containerd.runtimes.runc", {"runtime_type": "io.containerd.runc.v2"}),
        (f"{cri}.containerd.runtimes.runc.options", {"SystemdCgroup": False,
                                                     "BinaryName": runc}),
        (f"{cri}.cni", {"bin_dir": CNI_BIN_DIR, "conf_dir": cni_conf_dir,
                        "max_conf_num": 1}),
    ]
    lines: list[str] = []
    for header, values in sections:
        if header:
            lines.append(f"\n[{header}]")
        lines += [f"{k} = {_toml(str(v) if isinstance(v, Path) else v)}"
                  for k, v in values.items()]
    return "\n".join(lines).lstrip() + "\n"


def kubelet_config(net: NodeNet, *, socket: Path, ca_file: Path, port: int, healthz_port: int,
                   cgroup_root: str) -> dict[str, Any]:
    """KubeletConfiguration for the real node.

    The API server reaches the kubelet (logs, exec, port-forward) on the bridge
    address with the admin client certificate, so x509 against the cluster CA
    is the only authentication and every authenticated call is allowed.
    """
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": net.gateway,
        "port": port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz_port,
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False},
                           "x509": {"clientCAFile": str(ca_file)}},
        "authorization": {"mode": "AlwaysAllow"},
        "containerRuntimeEndpoint": f"unix://{socket}",
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": cgroup_root,
        "cgroupsPerQOS": True,
        "enforceNodeAllocatable": ["pods"],
        "failCgroupV1": False,
        "failSwapOn": False,
        "clusterDNS": [net.gateway],
        "clusterDomain": CLUSTER_DOMAIN,
        "resolvConf": "",  # pods get the cluster DNS only, not the host's resolvers
        "podCIDR": str(net.subnet),
        "maxPods": 30,
        "registerNode": True,
        "registerWithTaints": [dict(TAINT)],
        "serializeImagePulls": False,
        # The machine's disk is shared with builds and caches: evict only when it is
        # really full, and never garbage-collect the imported images.
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1Gi",
                         "imagefs.available": "1Gi"},
        "evictionPressureTransitionPeriod": "10s",
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "nodeStatusUpdateFrequency": "5s",
        "syncFrequency": "10s",
        "fileCheckFrequency": "10s",
        "rotateCertificates": False,
        "serverTLSBootstrap": False,
        "containerLogMaxSize": "10Mi",
    }


def kubelet_args(kubelet: Path, *, config: Path, kubeconfig: Path, root_dir: Path,
                 net: NodeNet, name: str = NODE_NAME) -> list[str]:
    labels = ",".join(f"{k}={v}" for k, v in sorted(LABELS.items()))
    return [str(kubelet), f"--config={config}", f"--kubeconfig={kubeconfig}",
            f"--root-dir={root_dir}", f"--cert-dir={root_dir / 'pki'}",
            f"--hostname-override={name}", f"--node-ip={net.gateway}",
            f"--node-labels={labels}", "--v=1"]


def cgroup_root_dirs(mounts: str, cgroup_root: str) -> list[Path]:
    """The node's cgroup root in each cgroup v1 hierarchy of /proc/mounts text
    (the kubelet refuses to start unless it exists in every one it uses)."""
    out = []
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 4 or fields[2] != "cgroup":
            continue
        options = set(fields[3].split(","))
        if options & set(CGROUP_V1_CONTROLLERS) or "name=systemd" in options:
            out.append(Path(fields[1]) / cgroup_root.strip("/"))
    return out


def mounts_under(mounts: str, root: Path) -> list[str]:
    """Mount points at or below `root`, deepest first (the order to unmount them)."""
    prefix = str(root).rstrip("/") + "/"
    points = []
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) >= 2:
            point = fields[1].replace("\\040", " ")
            if point == str(root) or point.startswith(prefix):
                points.append(point)
    return sorted(set(points), key=lambda p: (-p.count("/"), p))
