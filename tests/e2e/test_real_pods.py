"""Real pods: the kvmesh image on a real kubelet, requests through the router Service.

Real: the API server, scheduler, controller-manager, the operator, the kubelet
with containerd/runc/CNI (`e2e/cluster up --real-node`), the CPU image built by
e2e/image/build from this working tree, the engine and router processes in
their pods, the probes, the cluster DNS the router resolves engines with, the
official `openai` client. Reached from the host through `kubectl port-forward`
to the router Service (the path that also works on kind).
Nothing is faked. The CR asks for `model.dtype: float32`, so the expected tokens
are transformers' fp32 greedy tokens (realpods.py).

This module runs a colocated deployment (one engine with `--role both`);
test_real_pods_disagg.py runs prefill and decode pools.

Runs only when the session's cluster has a real node (KVMESH_E2E_REAL_NODE=1)
or KVMESH_E2E_REAL_PODS=1 on an external cluster that has the image loaded
(pods then go to the node labelled kvmesh.io/real-node=true if there is one,
else to the kvmesh.io/pool=cpu nodes, as on kind).
"""

from __future__ import annotations

import pytest

from .realpods import (QUESTIONS, answered_later, chat_matches_reference, deploy, engine_spec, metric,
                       pod_get, ready_pods, stream_while_deleting,
                       wait_for_replacement)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

NAME = "real"


@pytest.fixture(scope="module")
def deployment(cluster, namespace, operator, real_placement):
    deploy(cluster, namespace, NAME, engine_spec(cluster, real_placement, prefill=0))
    return namespace


def test_engine_runs_the_dtype_of_the_cr(cluster, deployment):
    (pod,) = ready_pods(cluster, deployment, NAME, "decode")
    args = pod.spec.containers[0].args
    assert args[:3] == ["serve", "--role", "both"]
    assert args[args.index("--dtype") + 1] == "float32"


def test_the_namespace_admits_only_restricted_pods(cluster, deployment):
    """The pods above started under ``pod-security.kubernetes.io/enforce=restricted``: the apiserver
    refuses a pod that falls short of it (here: one left at the defaults, root allowed)."""
    from kubernetes.client.rest import ApiException

    labels = cluster.core.read_namespace(deployment).metadata.labels
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    with pytest.raises(ApiException) as err:
        cluster.core.create_namespaced_pod(deployment, {
            "metadata": {"name": "not-restricted"},
            "spec": {"containers": [{"name": "c", "image": "kvmesh/kvmesh:0.1.0"}]}}, dry_run="All")
    assert err.value.status == 403 and "violates PodSecurity" in err.value.body
    for component in ("decode", "router"):
        assert ready_pods(cluster, deployment, NAME, component)


def test_chat_through_the_router_service_matches_transformers_fp32(router_url, hf_reference):
    for q in QUESTIONS:
        chat_matches_reference(router_url, hf_reference, q)


def test_engine_metrics_show_the_traffic(cluster, deployment, router_url):
    (pod,) = ready_pods(cluster, deployment, NAME, "decode")
    text = pod_get(cluster, deployment, pod.metadata.name, "/metrics")
    assert metric(text, "kvmesh_requests_finished_total") >= len(QUESTIONS), text[-2000:]


def test_engine_pod_deleted_mid_stream_is_replaced_and_picked_up(cluster, deployment, router_url,
                                                                 hf_reference):
    """The stream ends cleanly (complete answer or an error, never a hang); the
    Deployment replaces the pod and the router sends the next request to it."""
    (victim,) = ready_pods(cluster, deployment, NAME, "decode")
    stream_while_deleting(cluster, deployment, victim.metadata.name, router_url, hf_reference)
    wait_for_replacement(cluster, deployment, NAME, "decode", victim.metadata.name)
    answered_later(router_url, hf_reference, QUESTIONS[0])
