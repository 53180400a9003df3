"""Unit tests of the real node's pure parts: configs, DNS packets, pause image.

Nothing runs here: no kubelet, containerd or network. The DNS tests build
query packets by hand and parse the answers with the struct layout of RFC 1035.
"""

from __future__ import annotations

import io
import json
import socket
import struct
import sys
import tarfile
from pathlib import Path

import pytest

from .helpers import ROOT

sys.path.insert(0, str(ROOT / "e2e"))

from localcluster import dns, pause, realnode  # noqa: E402


def test_choose_net_skips_used_subnets():
    routes = ["default via 10.0.0.1 dev eth0", "10.245.1.0/24 dev kvmesh1 proto kernel",
              "10.245.2.0/24 dev kvmesh2", "172.17.0.0/16 dev docker0"]
    net = realnode.choose_net(routes)
    assert net.index == 3 and net.gateway == "10.245.3.1" and str(net.subnet) == "10.245.3.0/24"
    assert len(net.bridge) <= 15
    with pytest.raises(ValueError, match="stop another local cluster"):
        realnode.choose_net(["10.245.0.0/16 dev big"])


def test_cni_conflist_is_bridge_with_host_local_and_no_nat(tmp_path):
    conf = realnode.cni_conflist(realnode.NodeNet(7), tmp_path)
    bridge, firewall = conf["plugins"]
    assert bridge["bridge"] == "kvmesh7" and bridge["isGateway"] and not bridge["ipMasq"]
    assert bridge["ipam"]["ranges"] == [[{"subnet": "10.245.7.0/24", "gateway": "10.245.7.1"}]]
    assert bridge["ipam"]["dataDir"] == str(tmp_path)
    assert firewall["type"] == "firewall"


def test_containerd_config_keeps_everything_under_its_state_dir(tmp_path):
    text = realnode.containerd_config(tmp_path, "kvmesh.local/pause:1", "/usr/sbin/runc",
                                      tmp_path / "net.d")
    tomllib = pytest.importorskip("tomllib")
    cfg = tomllib.loads(text)
    assert cfg["version"] == 2 and cfg["root"] == str(tmp_path / "root")
    assert cfg["grpc"]["address"] == str(tmp_path / "containerd.sock")
    cri = cfg["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["sandbox_image"] == "kvmesh.local/pause:1"
    runc = cri["containerd"]["runtimes"]["runc"]
    assert runc["options"] == {"SystemdCgroup": False, "BinaryName": "/usr/sbin/runc"}
    assert cri["cni"]["conf_dir"] == str(tmp_path / "net.d")
    # The persistent image store moves the root (images, layers) alone out of the state dir.
    store = tomllib.loads(realnode.containerd_config(tmp_path, "p:1", "runc", tmp_path / "net.d",
                                                     root=tmp_path / "store"))
    assert store["root"] == str(tmp_path / "store")
    assert store["grpc"]["address"] == str(tmp_path / "containerd.sock")


def test_kubelet_config_taints_the_node_and_points_pods_at_the_cluster_dns(tmp_path):
    net = realnode.NodeNet(4)
    cfg = realnode.kubelet_config(net, socket=tmp_path / "c.sock", ca_file=tmp_path / "ca.crt",
                                  port=41000, healthz_port=41001, cgroup_root="/kvmesh-4")
    assert cfg["registerWithTaints"] == [realnode.TAINT]
    assert cfg["clusterDNS"] == ["10.245.4.1"] and cfg["address"] == "10.245.4.1"
    assert cfg["cgroupDriver"] == "cgroupfs" and cfg["cgroupRoot"] == "/kvmesh-4"
    assert cfg["authentication"]["anonymous"]["enabled"] is False
    args = realnode.kubelet_args(Path("/bin/kubelet"), config=tmp_path / "k.json",
                                 kubeconfig=tmp_path / "kc", root_dir=tmp_path, net=net)
    assert "--node-ip=10.245.4.1" in args
    assert "--node-labels=kvmesh.io/pool=real,kvmesh.io/real-node=true" in args


def test_cgroup_dirs_and_mounts_to_undo():
    mounts = ("cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0\n"
              "cgroup /sys/fs/cgroup/systemd cgroup rw,name=systemd 0 0\n"
              "cgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n"
              "tmpfs /s/node/kubelet/pods/x/volumes/a tmpfs rw 0 0\n"
              "overlay /s/node/containerd/state/r/rootfs overlay rw 0 0\n"
              "tmpfs /other tmpfs rw 0 0\n")
    assert realnode.cgroup_root_dirs(mounts, "/kvmesh-2") == [
        Path("/sys/fs/cgroup/cpu/kvmesh-2"), Path("/sys/fs/cgroup/systemd/kvmesh-2")]
    under = realnode.mounts_under(mounts, Path("/s"))
    assert set(under) == {"/s/node/kubelet/pods/x/volumes/a", "/s/node/containerd/state/r/rootfs"}
    assert under[0].count("/") >= under[-1].count("/")


def _query(name: str, qtype: int = dns.QTYPE_A, qid: int = 0x1234) -> bytes:
    q = struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0)
    for label in name.split("."):
        q += bytes([len(label)]) + label.encode()
    return q + b"\0" + struct.pack("!HH", qtype, 1)


def _parse_answer(packet: bytes) -> tuple[int, int, list[str]]:
    qid, flags, _qd, an, _ns, _ar = struct.unpack_from("!HHHHHH", packet)
    pos = 12
    while packet[pos]:
        pos += packet[pos] + 1
    pos += 5
    ips = []
    for _ in range(an):
        _ptr, rtype, _cls, _ttl, rdlen = struct.unpack_from("!HHHIH", packet, pos)
        pos += 12
        assert rtype == 1 and rdlen == 4
        ips.append(socket.inet_ntoa(packet[pos:pos + 4]))
        pos += 4
    return qid, flags & 0xF, ips


SERVICES = [{"metadata": {"namespace": "ns", "name": "m-decode"}},
            {"metadata": {"namespace": "ns", "name": "m-router"}}]
SLICES = [{"metadata": {"namespace": "ns", "labels": {"kubernetes.io/service-name": "m-decode"}},
           "addressType": "IPv4",
           "endpoints": [{"addresses": ["10.245.1.5"], "conditions": {"ready": True}},
                         {"addresses": ["10.245.1.6"], "conditions": {"ready": False}},
                         {"addresses": ["10.245.1.7"]}]}]


def test_dns_answers_ready_endpoints_of_a_service():
    table = dns.records(SERVICES, SLICES)
    assert table == {"m-decode.ns.svc.cluster.local": ["10.245.1.5", "10.245.1.7"],
                     "m-router.ns.svc.cluster.local": []}
    qid, rcode, ips = _parse_answer(dns.answer(_query("M-Decode.ns.svc.cluster.local"), table))
    assert (qid, rcode, ips) == (0x1234, dns.NOERROR, ["10.245.1.5", "10.245.1.7"])
    # AAAA for a known name: no data, not NXDOMAIN (resolvers then use the A answer).
    assert _parse_answer(dns.answer(_query("m-decode.ns.svc.cluster.local", 28), table))[1:] == (
        dns.NOERROR, [])
    # Search-list expansions and foreign names do not exist.
    for name in ("m-decode.ns.svc.ns.svc.cluster.local", "example.com"):
        assert _parse_answer(dns.answer(_query(name), table))[1] == dns.NXDOMAIN


def test_dns_rejects_malformed_packets():
    assert struct.unpack_from("!H", dns.answer(b"\x12\x34\x01", {}), 2)[0] & 0xF == dns.FORMERR
    truncated = _query("a.b")[:-3]
    assert struct.unpack_from("!H", dns.answer(truncated, {}), 2)[0] & 0xF == dns.FORMERR


def test_pause_image_archive_is_a_docker_save_layout():
    data = pause.image_archive(b"\x7fELF fake", tag="kvmesh.local/pause:1")
    assert data == pause.image_archive(b"\x7fELF fake", tag="kvmesh.local/pause:1")
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        manifest = json.load(tar.extractfile("manifest.json"))
        [entry] = manifest
        assert entry["RepoTags"] == ["kvmesh.local/pause:1"]
        config = json.load(tar.extractfile(entry["Config"]))
        layer = tar.extractfile(entry["Layers"][0]).read()
    assert config["config"]["Entrypoint"] == ["/pause"]
    with tarfile.open(fileobj=io.BytesIO(layer)) as inner:
        member = inner.getmember("pause")
        assert member.mode == 0o755 and inner.extractfile(member).read() == b"\x7fELF fake"
