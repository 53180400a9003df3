"""Real pods, disaggregated: a prefill pool and a decode pool on the real node, KV over UCX.

The same setting as test_real_pods.py (the kvmesh image on a real kubelet, requests through the
router Service by `kubectl port-forward`, nothing faked), with `prefill.replicas: 1`: the
operator renders `kvmesh serve --role prefill` and `--role decode --kv-transfer-port 8001`, and
the router runs each request in two stages (docs/disagg.md). The prefill engine pushes the
prompt's KV to the decode engine's pod over UCX (TCP between the two pods' addresses), and the
client gets transformers' fp32 greedy tokens (realpods.py), first token from the prefill pod,
the rest from the decode pod.
"""

from __future__ import annotations

import json

import pytest

from .realpods import (QUESTIONS, answered_later, chat_matches_reference, deploy, engine_spec, metric,
                       pod_get, pod_internal_get, ready_pods, stream_while_deleting,
                       wait_for_replacement)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

NAME = "pd"
HANDOFFS = "kvmesh_kv_handoffs_total"


@pytest.fixture(scope="module")
def deployment(cluster, namespace, operator, real_placement):
    deploy(cluster, namespace, NAME, engine_spec(cluster, real_placement, prefill=1))
    return namespace


def _handoffs(cluster, ns, outcome="ok") -> float:
    (prefill,) = ready_pods(cluster, ns, NAME, "prefill")
    return metric(pod_get(cluster, ns, prefill.metadata.name, "/metrics"), HANDOFFS, outcome=outcome)


def test_pools_run_their_roles_and_the_decode_pod_listens_for_kv(cluster, deployment):
    for component, role, port in (("prefill", "prefill", None), ("decode", "decode", 8001)):
        (pod,) = ready_pods(cluster, deployment, NAME, component)
        args = pod.spec.containers[0].args
        assert args[args.index("--role") + 1] == role
        assert args[args.index("--dtype") + 1] == "float32"
        info = json.loads(pod_internal_get(cluster, deployment, NAME, pod.metadata.name, "/kv/info"))
        assert (info["role"], info["transfer_port"]) == (role, port), info


def test_chat_through_the_router_service_matches_transformers_fp32(cluster, deployment, router_url,
                                                                   hf_reference):
    before = _handoffs(cluster, deployment)
    for q in QUESTIONS:
        r = chat_matches_reference(router_url, hf_reference, q)
        assert r.usage.completion_tokens > 1  # the first token from prefill, the rest from decode
    # Each request went through the two stages: the prefill pod handed its KV to the decode pod.
    assert _handoffs(cluster, deployment) >= before + len(QUESTIONS)


def test_prefill_metrics_count_the_handoffs(cluster, deployment, router_url):
    (prefill,) = ready_pods(cluster, deployment, NAME, "prefill")
    text = pod_get(cluster, deployment, prefill.metadata.name, "/metrics")
    assert metric(text, HANDOFFS, outcome="ok") > 0, [
        line for line in text.splitlines() if "handoff" in line or "transfer" in line]
    assert metric(text, "kvmesh_kv_handoff_bytes_total") > 0
    failed = {line for line in text.splitlines() if line.startswith(HANDOFFS) and 'outcome="ok"' not in line}
    print(f"\nprefill handoffs not ok: {failed or 'none'}")


def test_decode_pod_deleted_mid_stream_is_replaced_and_picked_up(cluster, deployment, router_url,
                                                                 hf_reference):
    """The stream from the decode pod ends cleanly (complete answer or an error, never a hang); the
    Deployment replaces the pod, and a later request goes through both stages to the new one."""
    (victim,) = ready_pods(cluster, deployment, NAME, "decode")
    stream_while_deleting(cluster, deployment, victim.metadata.name, router_url, hf_reference)
    new = wait_for_replacement(cluster, deployment, NAME, "decode", victim.metadata.name)
    before = _handoffs(cluster, deployment)
    answered_later(router_url, hf_reference, QUESTIONS[1])
    assert _handoffs(cluster, deployment) > before, "the later request did not go through the prefill pod"
    info = json.loads(pod_internal_get(cluster, deployment, NAME, new.metadata.name, "/kv/info"))
    assert (info["role"], info["transfer_port"]) == ("decode", 8001)
