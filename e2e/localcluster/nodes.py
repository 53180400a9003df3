"""Fake nodes for kwok: a GPU pool and a pool of big-memory CPU nodes.

kwok manages only nodes annotated `kwok.x-k8s.io/node: fake` (the harness
starts it with that selector), keeps the capacity they were created with and
reports them Ready. GPU nodes are labelled and tainted the way GPU pools are
on real clusters (the NVIDIA device plugin's resource name, a NoSchedule
taint that only pods asking for GPUs tolerate), so the real scheduler has to
make the placement decisions the operator's manifests are meant to cause.
"""

from __future__ import annotations

from typing import Any

GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
KWOK_ANNOTATION = {"kwok.x-k8s.io/node": "fake"}


def node(name: str, pool: str, capacity: dict[str, str], labels: dict[str, str],
         taints: list[dict[str, str]]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": dict(KWOK_ANNOTATION),
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                "kvmesh.io/pool": pool,
                **labels,
            },
        },
        "spec": {"taints": taints} if taints else {},
        "status": {"capacity": dict(capacity), "allocatable": dict(capacity)},
    }


def gpu_node(i: int, gpus: int = 8) -> dict[str, Any]:
    return node(
        f"kwok-gpu-{i}",
        "gpu",
        {"cpu": "96", "memory": "1Ti", "pods": "110", "nvidia.com/gpu": str(gpus),
         "ephemeral-storage": "2Ti"},
        {
            "node.kubernetes.io/instance-type": f"gpu-{gpus}x",
            "nvidia.com/gpu.present": "true",
            "nvidia.com/gpu.count": str(gpus),
        },
        [dict(GPU_TAINT)],
    )


def cpu_node(i: int) -> dict[str, Any]:
    return node(
        f"kwok-cpu-{i}",
        "cpu",
        {"cpu": "64", "memory": "512Gi", "pods": "110", "ephemeral-storage": "1Ti"},
        {"node.kubernetes.io/instance-type": "cpu-highmem"},
        [],
    )


def cluster_nodes(gpu_nodes: int, cpu_nodes: int) -> list[dict[str, Any]]:
    return [gpu_node(i) for i in range(gpu_nodes)] + [cpu_node(i) for i in range(cpu_nodes)]


def is_ready(obj: dict[str, Any]) -> bool:
    for cond in (obj.get("status") or {}).get("conditions") or ():
        if cond.get("type") == "Ready":
            return cond.get("status") == "True"
    return False
