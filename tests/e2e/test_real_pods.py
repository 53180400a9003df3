"""Real pods: the kvmesh image on a real kubelet, requests through the router Service.

Real: the API server, scheduler, controller-manager, the operator, the kubelet
with containerd/runc/CNI (`e2e/cluster up --real-node`), the CPU image built by
e2e/image/build from this working tree, the engine and router processes in
their pods, the probes, the cluster DNS the router resolves engines with, the
official `openai` client. Reached from the host through `kubectl port-forward`
to the router Service (the path that also works on kind).
Nothing is faked. Expected tokens come from the offline engine in this process
at the pods' dtype (bf16, the engine's default: the CR has no dtype field).

Runs only when the session's cluster has a real node (KVMESH_E2E_REAL_NODE=1)
or KVMESH_E2E_REAL_PODS=1 on an external cluster that has the image loaded
(pods then go to the node labelled kvmesh.io/real-node=true if there is one,
else to the kvmesh.io/pool=cpu nodes, as on kind).
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time

import httpx
import openai
import pytest

from .helpers import IMAGE, ROOT, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

NAME = "real"
MODEL = "smollm2-135m-instruct"
QUESTIONS = ["What is the capital of France?", "Name three primary colors."]
MAX_TOKENS = 16
LOCAL_PLACEMENT = {
    "nodeSelector": {"kvmesh.io/real-node": "true"},
    "tolerations": [{"key": "kvmesh.io/real-node", "operator": "Exists", "effect": "NoSchedule"}],
}
KIND_PLACEMENT = {"nodeSelector": {"kvmesh.io/pool": "cpu"}}


@pytest.fixture(scope="module")
def real(cluster):
    if cluster.local and not cluster.real_node:
        pytest.skip("the local cluster has no real node (set KVMESH_E2E_REAL_NODE=1)")
    if not cluster.local and os.environ.get("KVMESH_E2E_REAL_PODS") != "1":
        pytest.skip("real pods on an external cluster need KVMESH_E2E_REAL_PODS=1 and the image loaded")
    if cluster.local:
        started = time.monotonic()
        subprocess.run([str(ROOT / "e2e" / "image" / "build"), "--tag", IMAGE], check=True,
                       timeout=3600)
        subprocess.run([str(ROOT / "e2e" / "cluster"), "load-image", str(cluster.state_dir), IMAGE],
                       check=True, timeout=1800)
        print(f"\nimage built and imported in {time.monotonic() - started:.0f}s")
    real_nodes = cluster.core.list_node(label_selector="kvmesh.io/real-node=true").items
    return LOCAL_PLACEMENT if real_nodes else KIND_PLACEMENT


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def deployment(cluster, namespace, operator, real):
    spec = {
        "model": {"name": MODEL},
        "image": IMAGE,
        "imagePullPolicy": "Never" if cluster.local else "IfNotPresent",
        "prefill": {"replicas": 0},
        "decode": {"replicas": 1, "resources": {"gpus": 0}, **real},
        "cache": {"replicas": 0},
        "router": {"replicas": 1, **real},
    }
    cluster.create_cr(namespace, NAME, spec)
    wait_until("decode and router pods Ready", lambda: _ready_pods(cluster, namespace, "decode")
               and _ready_pods(cluster, namespace, "router"), timeout=900, every=2)
    return namespace


def _ready_pods(cluster, ns, component) -> list:
    pods = cluster.core.list_namespaced_pod(
        ns, label_selector=f"app.kubernetes.io/instance={NAME},app.kubernetes.io/component={component}")
    return [p for p in pods.items if p.metadata.deletion_timestamp is None and any(
        c.type == "Ready" and c.status == "True" for c in p.status.conditions or ())]


@pytest.fixture(scope="module")
def router_url(cluster, deployment):
    port = _free_port()
    proc = subprocess.Popen(["kubectl", "-n", deployment, "port-forward", f"svc/{NAME}-router",
                             f"{port}:8000", "--address", "127.0.0.1"], env=cluster.env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return httpx.get(f"{url}/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until("router reachable through port-forward", healthy, timeout=120, every=1)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def offline():
    from kvmesh.engine.config import EngineConfig
    from kvmesh.engine.llm import LLM

    return LLM(EngineConfig(model="default", dtype="bfloat16"))


def _expected(offline, question, max_tokens=MAX_TOKENS):
    from kvmesh.engine.sampling import SamplingParams

    return offline.chat([[{"role": "user", "content": question}]],
                        SamplingParams(max_tokens=max_tokens, temperature=0.0))[0]


def _client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)


def test_chat_through_the_router_service_matches_the_offline_engine(router_url, offline):
    client = _client(router_url)
    for q in QUESTIONS:
        exp = _expected(offline, q)
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}],
                                           temperature=0, max_tokens=MAX_TOKENS)
        assert r.choices[0].message.content == exp.text
        assert r.usage.completion_tokens == len(exp.token_ids)


def test_engine_metrics_show_the_traffic(cluster, deployment, router_url):
    (pod,) = _ready_pods(cluster, deployment, "decode")
    text = cluster.kubectl("get", "--raw", f"/api/v1/namespaces/{deployment}/pods/"
                           f"{pod.metadata.name}:8000/proxy/metrics").stdout
    done = [line for line in text.splitlines()
            if line.startswith("kvmesh_") and "request" in line and "_count" in line]
    assert done and any(float(line.rsplit(" ", 1)[1]) >= len(QUESTIONS) for line in done), done


def test_engine_pod_deleted_mid_stream_is_replaced_and_picked_up(cluster, deployment, router_url,
                                                                 offline):
    """The stream ends cleanly (complete answer or an error, never a hang); the
    Deployment replaces the pod and the router sends the next request to it."""
    (victim,) = _ready_pods(cluster, deployment, "decode")
    client = _client(router_url)
    outcome: dict = {}
    first = threading.Event()

    def stream():
        try:
            chunks = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Tell me a long story."}],
                temperature=0, max_tokens=200, stream=True)
            text = ""
            for chunk in chunks:
                first.set()
                text += chunk.choices[0].delta.content or "" if chunk.choices else ""
            outcome["text"] = text
        except (openai.APIError, httpx.HTTPError) as exc:
            outcome["error"] = exc
        finally:
            first.set()

    t = threading.Thread(target=stream)
    t.start()
    assert first.wait(300), "no first token"
    cluster.core.delete_namespaced_pod(victim.metadata.name, deployment)
    t.join(600)
    assert not t.is_alive(), "the stream hung after its engine pod was deleted"
    assert "text" in outcome or "error" in outcome
    print(f"\nstream after its engine pod was deleted: {sorted(outcome)}")
    if "text" in outcome:  # drained or retried: then it must be the whole greedy answer
        assert outcome["text"] == _expected(offline, "Tell me a long story.", 200).text
    wait_until("a replacement decode pod Ready", lambda: [
        p for p in _ready_pods(cluster, deployment, "decode")
        if p.metadata.name != victim.metadata.name], timeout=900, every=2)
    q = QUESTIONS[0]
    exp = _expected(offline, q)

    def answered():
        try:
            r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}],
                                               temperature=0, max_tokens=MAX_TOKENS)
        except openai.APIError:
            return None
        return r

    r = wait_until("the router to use the new pod", answered, timeout=120, every=2)
    assert r.choices[0].message.content == exp.text
