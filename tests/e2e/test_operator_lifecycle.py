"""The operator against the real control plane: children, placement by the
real scheduler, status, scaling, repair, idempotence, cascade deletion.

The tests share one InferenceDeployment and run in file order."""

from __future__ import annotations

import time

import pytest

from .helpers import IMAGE, condition, wait_until

pytestmark = pytest.mark.e2e

NAME = "smollm2"
SPEC = {
    "model": {"name": "smollm2-135m-instruct"},
    "image": IMAGE,
    "prefill": {"replicas": 1},
    "decode": {"replicas": 2},
    "cache": {"replicas": 1},
    "router": {"replicas": 1},
    "slo": {"ttftMs": 500, "tpotMs": 50},
}
COMPONENTS = ("prefill", "decode", "cache", "router")


def ready(cluster, ns):
    obj = cluster.get_cr(ns, NAME)
    if condition(obj, "Ready").get("status") == "True" and \
            obj["status"]["observedGeneration"] == obj["metadata"]["generation"]:
        return obj
    return None


def generations(cluster, ns):
    return {c: (d.metadata.uid, d.metadata.generation, d.metadata.resource_version)
            for c, d in cluster.deployments(ns, NAME).items()}


def test_children_are_created_with_owner_references(cluster, namespace, operator):
    cr = cluster.create_cr(namespace, NAME, SPEC)
    uid = cr["metadata"]["uid"]
    deps = wait_until("four Deployments",
                      lambda: (d := cluster.deployments(namespace, NAME)) and len(d) == 4 and d)
    for component, d in deps.items():
        (ref,) = d.metadata.owner_references
        assert (ref.uid, ref.kind, ref.controller) == (uid, "InferenceDeployment", True)
        ctr = d.spec.template.spec.containers[0]
        assert ctr.command == ["kvmesh"]
        assert ctr.args[0] == ("cache-node" if component == "cache" else
                               "router" if component == "router" else "serve")
    assert deps["decode"].spec.replicas == 2
    # A pass applies each Deployment before its Service: wait for the last Service too.
    services = wait_until("four Services", lambda: (svc := {
        s.metadata.name: s for s in cluster.core.list_namespaced_service(namespace).items
        if s.metadata.name.startswith(f"{NAME}-")}) and len(svc) == 4 and svc)
    for c in ("prefill", "decode", "cache"):
        assert services[f"{NAME}-{c}"].spec.cluster_ip == "None"
    assert services[f"{NAME}-router"].spec.cluster_ip not in (None, "None")
    cm = cluster.core.read_namespaced_config_map(f"{NAME}-config", namespace)
    assert "smollm2-135m-instruct" in cm.data["kvmesh.yaml"]


def test_status_becomes_ready(cluster, namespace, operator):
    obj = wait_until("Ready=True", lambda: ready(cluster, namespace), timeout=90)
    comps = obj["status"]["components"]
    assert {c: comps[c]["ready"] for c in COMPONENTS} == {
        "prefill": "1/1", "decode": "2/2", "cache": "1/1", "router": "1/1"}
    assert obj["status"]["routerURL"] == f"http://{NAME}-router.{namespace}.svc:8000"
    assert condition(obj, "Degraded")["status"] == "False"
    assert condition(obj, "Progressing")["status"] == "False"


def test_scheduler_places_gpu_pools_on_gpu_nodes(cluster, namespace, operator):
    gpu_nodes = {n.metadata.name for n in cluster.core.list_node().items
                 if int((n.status.allocatable or {}).get("nvidia.com/gpu", "0")) > 0}
    assert gpu_nodes, "the cluster needs a GPU node pool (nodes with nvidia.com/gpu)"
    pods = cluster.core.list_namespaced_pod(
        namespace, label_selector=f"app.kubernetes.io/instance={NAME}").items
    placed: dict[str, set[str]] = {}
    for p in pods:
        assert p.spec.node_name, f"{p.metadata.name} is not scheduled"
        placed.setdefault(p.metadata.labels["app.kubernetes.io/component"], set()).add(
            p.spec.node_name)
    assert placed.keys() == set(COMPONENTS)
    for c in ("prefill", "decode"):
        assert placed[c] <= gpu_nodes, placed
    for c in ("cache", "router"):
        assert not placed[c] & gpu_nodes, placed


def test_reapplying_the_same_spec_changes_nothing(cluster, namespace, operator):
    before = generations(cluster, namespace)
    cluster.patch_cr(namespace, NAME, {"spec": SPEC})  # no-op edit
    cluster.patch_cr(namespace, NAME, {"metadata": {"labels": {"touched": "yes"}}})
    wait_until("a reconcile pass", lambda: ready(cluster, namespace))
    time.sleep(3)  # give any (wrong) write time to land
    assert generations(cluster, namespace) == before


def test_scaling_decode_updates_only_its_deployment(cluster, namespace, operator):
    before = generations(cluster, namespace)
    cluster.patch_cr(namespace, NAME, {"spec": {"decode": {"replicas": 3}}})
    wait_until("decode Deployment at 3 replicas",
               lambda: cluster.deployments(namespace, NAME)["decode"].spec.replicas == 3)
    obj = wait_until("Ready with 3 decode pods", lambda: (o := ready(cluster, namespace)) and
                     o["status"]["components"]["decode"]["ready"] == "3/3" and o, timeout=90)
    assert obj["status"]["components"]["decode"]["desiredReplicas"] == 3
    after = generations(cluster, namespace)
    for c in ("prefill", "cache", "router"):
        assert after[c][:2] == before[c][:2], c
    decode = cluster.deployments(namespace, NAME)["decode"]
    assert decode.metadata.generation == before["decode"][1] + 1  # scaled, not re-templated


def test_editing_router_policy_rolls_only_the_router(cluster, namespace, operator):
    before = generations(cluster, namespace)
    cluster.patch_cr(namespace, NAME, {"spec": {"router": {"policy": "least-load"}}})
    wait_until("router args updated", lambda: "least-load" in cluster.deployments(
        namespace, NAME)["router"].spec.template.spec.containers[0].args)
    wait_until("Ready after the rollout", lambda: ready(cluster, namespace), timeout=90)
    after = generations(cluster, namespace)
    for c in ("prefill", "decode", "cache"):
        assert after[c][:2] == before[c][:2], c


def test_deleted_child_comes_back(cluster, namespace, operator):
    old_uid = cluster.deployments(namespace, NAME)["cache"].metadata.uid
    cluster.apps.delete_namespaced_deployment(f"{NAME}-cache", namespace)
    wait_until("cache Deployment re-created", lambda: (
        d := cluster.deployments(namespace, NAME).get("cache")) and d.metadata.uid != old_uid)
    cluster.core.delete_namespaced_service(f"{NAME}-router", namespace)
    wait_until("router Service re-created", lambda: cluster.core.list_namespaced_service(
        namespace, field_selector=f"metadata.name={NAME}-router").items)
    wait_until("Ready again", lambda: ready(cluster, namespace), timeout=90)


def test_hand_edits_are_reverted(cluster, namespace, operator):
    cluster.kubectl("scale", "deployment", f"{NAME}-router", "--replicas=4", "-n", namespace)
    cluster.kubectl("set", "image", f"deployment/{NAME}-prefill", "prefill=evil:latest",
                    "-n", namespace)
    wait_until("router back at 1 replica and prefill image restored", lambda: (
        (d := cluster.deployments(namespace, NAME))["router"].spec.replicas == 1
        and d["prefill"].spec.template.spec.containers[0].image == IMAGE))


def test_deleting_the_resource_removes_every_child(cluster, namespace, operator):
    cluster.custom.delete_namespaced_custom_object(
        "serving.kvmesh.io", "v1alpha1", namespace, "inferencedeployments", NAME)
    label = f"app.kubernetes.io/instance={NAME}"
    wait_until("children garbage-collected", lambda: not (
        cluster.apps.list_namespaced_deployment(namespace, label_selector=label).items
        or cluster.core.list_namespaced_service(namespace, label_selector=label).items
        or cluster.core.list_namespaced_config_map(namespace, label_selector=label).items),
        timeout=90)
    wait_until("pods gone", lambda: not cluster.core.list_namespaced_pod(
        namespace, label_selector=label).items, timeout=90)
