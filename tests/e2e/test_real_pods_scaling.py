"""Real pods: a cache node shared by two engine pods, and a scale-down through the operator's drain.

The same setting as test_real_pods.py (the kvmesh image on a real kubelet, requests through the
router Service by `kubectl port-forward` or to one pod through the API server's pod proxy,
transformers' fp32 greedy tokens as the reference, nothing faked), with a colocated pool of two
engine pods, one cache node (`kvmesh cache-node`; the engines run `--cache-node`) and the
autoscaler on:

- KV written through by one engine pod to the cache node is reloaded by the other pod, over UCX
  between the pods, and the tokens stay exact;
- the user lowers `decode.minReplicas` from 2 to 1 while a long stream runs on each pod. The
  operator's autoscaler (a real tick every 2 s, scraping the pods) drains the pod with the least
  in-flight work (POST /admin/drain), waits until its stream has finished, then lowers the
  Deployment's replicas so that the ReplicaSet removes exactly that pod. No request is cut: both
  streams end with the whole greedy answer, and requests sent during the drain are answered by
  the other pod. Mid-drain the operator is killed (SIGKILL) and a new one started: it finds the
  drain recorded on the victim and resumes it.

The operator reaches the pods' IPs directly (it runs on the host, which is the real node); on a
cluster whose pod network the host cannot reach (kind), the drain test needs the operator in the
cluster and is skipped.
"""

from __future__ import annotations

import json

import pytest

from kvmesh.engine.config import EngineConfig
from kvmesh.operator.scaling import DRAIN_ANNOTATION

from .helpers import wait_until
from .realpods import (MAX_TOKENS, QUESTIONS, Stream, chat_matches_reference, check_completion, deploy,
                       engine_spec, metric, pod_chat, pod_get, pod_internal_get, ready_pods)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

NAME = "scale"
# The autoscaler ticks every 2 s, so that a scale-down starts seconds after the floor is lowered.
OPERATOR_ARGS = ("--autoscale-period", "2")
SCALE_DOWN_WINDOW_S = 10
# Long enough that both streams are still running when the drain starts (about
# SCALE_DOWN_WINDOW_S + two ticks after the patch); the test checks that they were.
STREAMS = ("Tell me a long story about a lighthouse keeper and a storm.",
           "Write a long essay about the history of bread.")
STREAM_TOKENS = 300
BLOCK = EngineConfig.block_size  # the pods run the engine's default
# Several KV blocks beyond the chat template's system prompt.
LONG_QUESTION = ("Here are my notes from the garden this week. The tomatoes ripened early, the "
                 "beans climbed past the fence, the lettuce bolted in the heat, a hedgehog slept "
                 "under the compost heap, and the apple tree dropped half of its fruit before "
                 "August. The soil stayed dry although I watered every evening. In one sentence, "
                 "what should I change next year?")
REMOTE = {"tier": "remote"}


@pytest.fixture(scope="module")
def deployment(cluster, namespace, operator, real_placement):
    spec = engine_spec(cluster, real_placement, prefill=0, cache=1)
    spec["decode"].update(replicas=2, minReplicas=2, maxReplicas=2)
    spec["cache"].update(memory="256Mi", **real_placement)
    spec["autoscaling"] = {"enabled": True, "scaleDownStabilizationSeconds": SCALE_DOWN_WINDOW_S,
                           "scaleUpStabilizationSeconds": 0, "metricsWindowSeconds": 10}
    deploy(cluster, namespace, NAME, spec)
    return namespace


def _engines(cluster, ns) -> list[str]:
    return sorted(p.metadata.name for p in ready_pods(cluster, ns, NAME, "decode"))


def test_engines_and_router_are_given_the_cache_service(cluster, deployment):
    for component in ("decode", "router"):
        for pod in ready_pods(cluster, deployment, NAME, component):
            args = pod.spec.containers[0].args
            assert args[args.index("--cache-node") + 1].startswith(f"{NAME}-cache."), args
    (node,) = ready_pods(cluster, deployment, NAME, "cache")
    assert node.spec.containers[0].args[:1] == ["cache-node"]


def test_one_pod_reloads_from_the_cache_node_what_the_other_wrote(cluster, deployment, hf_reference):
    """Pod A prefills the prompt and writes its KV blocks through to the cache node; pod B, which
    never saw the prompt, reloads them from the node instead of recomputing, with exact tokens."""
    a, b = _engines(cluster, deployment)
    (node,) = ready_pods(cluster, deployment, NAME, "cache")
    first = check_completion(hf_reference, LONG_QUESTION, MAX_TOKENS,
                             pod_chat(cluster, deployment, a, LONG_QUESTION), f"pod {a}: ")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    prompt_blocks = first.usage.prompt_tokens // BLOCK

    def stored() -> float:
        return metric(pod_get(cluster, deployment, a, "/metrics"), "kvmesh_kv_tier_stored_total", **REMOTE)

    wait_until(f"pod {a} to write its blocks through to the cache node",
               lambda: stored() >= prompt_blocks - 1, timeout=60, every=1)
    node_text = pod_get(cluster, deployment, node.metadata.name, "/metrics")
    assert metric(node_text, "kvmesh_cachenode_puts_total") >= prompt_blocks - 1, node_text[-1500:]

    second = check_completion(hf_reference, LONG_QUESTION, MAX_TOKENS,
                              pod_chat(cluster, deployment, b, LONG_QUESTION), f"pod {b}, reloading: ")
    cached = second.usage.prompt_tokens_details.cached_tokens
    # Every full block of the prompt but the last (the engine recomputes at least one token).
    assert cached >= (prompt_blocks - 1) * BLOCK, second.usage
    b_text = pod_get(cluster, deployment, b, "/metrics")
    assert metric(b_text, "kvmesh_kv_tier_promotions_total", **REMOTE) >= prompt_blocks - 1, [
        line for line in b_text.splitlines() if "tier" in line and "remote" in line]
    print(f"\npod {b} reloaded {cached} of {second.usage.prompt_tokens} prompt tokens "
          f"from the cache node")


def test_the_cr_says_the_router_routes_by_prefix(cluster, deployment):
    """The operator reads the router pod's /ready report (its tokenizer, engines hashing other
    blocks) into the CacheAwareRouting condition."""
    if not cluster.local:
        pytest.skip("the operator runs on the host and reaches pod IPs only on the local real node")

    def routing() -> dict | None:
        conds = ((cluster.get_cr(deployment, NAME) or {}).get("status") or {}).get("conditions") or ()
        return next((c for c in conds if c["type"] == "CacheAwareRouting" and c["status"] == "True"), None)

    c = wait_until("the CacheAwareRouting condition", routing, timeout=120, every=1)
    assert c["reason"] == "PrefixRouting" and "1 router pod(s)" in c["message"], c


def _in_flight(cluster, ns, pod: str) -> int:
    return int(json.loads(pod_internal_get(cluster, ns, NAME, pod, "/admin/drain"))["in_flight"])


def _events(cluster, ns) -> list:
    return [e for e in cluster.core.list_namespaced_event(ns).items
            if e.involved_object.kind == "InferenceDeployment" and e.involved_object.name == NAME]


def _draining_pod(cluster, ns) -> str | None:
    status = (cluster.get_cr(ns, NAME) or {}).get("status") or {}
    return ((status.get("autoscaling") or {}).get("decode") or {}).get("drainingPod")


def test_scale_down_drains_the_victim_and_cuts_no_request(cluster, deployment, router_url,
                                                          hf_reference, operator):
    if not cluster.local:
        pytest.skip("the operator runs on the host and reaches pod IPs only on the local real node")
    for q in STREAMS:  # the references first, so that nothing competes with the streams later
        hf_reference.greedy(q, STREAM_TOKENS)
    pods = _engines(cluster, deployment)
    streams = []
    for q in STREAMS:  # one after the other: the router's load score sends the second elsewhere
        streams.append(Stream(router_url, q, STREAM_TOKENS).started())
    busy = {p: _in_flight(cluster, deployment, p) for p in pods}
    assert all(n >= 1 for n in busy.values()), f"both pods must have a stream in flight: {busy}"

    cluster.patch_cr(deployment, NAME, {"spec": {"decode": {"minReplicas": 1}}})
    victim = wait_until("the autoscaler to drain a decode pod", lambda: _draining_pod(cluster, deployment),
                        timeout=120, every=0.5)
    assert victim in pods
    assert any(s.is_alive() for s in streams), "the streams ended before the drain started"
    drained_while_busy = _in_flight(cluster, deployment, victim)
    print(f"\ndraining {victim} with {drained_while_busy} stream(s) in flight")
    assert drained_while_busy >= 1, "the victim had nothing in flight when its drain started"

    # While the victim drains, new requests go to the other pod and are answered exactly.
    for q in QUESTIONS:
        chat_matches_reference(router_url, hf_reference, q, where="during the drain: ")
    assert _draining_pod(cluster, deployment) == victim, "the drain ended before its stream did"
    assert cluster.deployments(deployment, NAME)["decode"].spec.replicas == 2

    # The operator dies mid-drain (SIGKILL: nothing cleaned up) and another takes its place. The
    # drain is recorded on the victim, so the new leader resumes it instead of leaving the
    # victim unready and unremoved.
    record = cluster.core.read_namespaced_pod(victim, deployment).metadata.annotations or {}
    assert DRAIN_ANNOTATION in record, record
    operator.restart(sig_kill=True)
    wait_until("the new operator to lead", operator.is_leader, timeout=60)
    wait_until("the new operator to resume the drain", lambda: any(
        e.reason == "DrainResumed" and victim in e.message for e in _events(cluster, deployment)),
        timeout=120, every=1)
    assert _draining_pod(cluster, deployment) == victim

    for i, s in enumerate(streams):
        s.finished()
        s.check_complete(hf_reference, f"stream {i} across the scale-down")

    def removed() -> bool:
        return victim not in [p.metadata.name for p in cluster.core.list_namespaced_pod(
            deployment, label_selector=f"app.kubernetes.io/instance={NAME},"
                                       "app.kubernetes.io/component=decode").items]

    wait_until(f"the drained pod {victim} to be removed", removed, timeout=600, every=1)
    assert cluster.deployments(deployment, NAME)["decode"].spec.replicas == 1
    (survivor,) = _engines(cluster, deployment)
    assert survivor != victim
    status = cluster.get_cr(deployment, NAME)["status"]["autoscaling"]["decode"]
    # A merge patch drops a null: no drainingPod key once the drain is over.
    assert status["desiredReplicas"] == 1 and status.get("drainingPod") is None, status
    events = [(e.reason, e.message) for e in _events(cluster, deployment)]
    assert any(r == "DrainingPod" and victim in m for r, m in events), events
    # "drained in": the operator saw in_flight 0 before lowering replicas (not its time-out).
    (done,) = [m for r, m in events if r == "ScaledDown" and victim in m]
    assert "drained in" in done, events
    print(f"\n{done}")
    chat_matches_reference(router_url, hf_reference, QUESTIONS[0], where="after the scale-down: ")
