"""Shared parts of the real-pod tests (test_real_pods.py, test_real_pods_disagg.py).

The pods run the kvmesh image with `model.dtype: float32`, so their greedy tokens are checked
against transformers' fp32 greedy tokens for the same chat prompt (the reference
tests/engine/test_parity_hf.py builds). Token by token: the server returns each output token's
text in `logprobs`, the reference's ids are decoded one at a time the same way. Where they
differ, transformers' own top-2 logits at that position must be a near tie (< 1e-3 apart), as
in test_parity_hf; the comparison stops there, since past it the contexts differ.
"""

from __future__ import annotations

import functools
import subprocess
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import httpx
import openai
from openai.types.chat import ChatCompletion

from .helpers import IMAGE, Cluster, free_port, wait_until

MODEL = "smollm2-135m-instruct"
DTYPE = "float32"  # the reference's dtype
QUESTIONS = ["What is the capital of France?", "Name three primary colors."]
MAX_TOKENS = 16
STORY = "Tell me a long story."
STORY_TOKENS = 200
NEAR_TIE = 1e-3
# Extensions of the chat request the engine accepts: run the full length (as the reference does)
# and return each token's text.
GREEDY = {"temperature": 0, "logprobs": True, "extra_body": {"ignore_eos": True}}


# ---- the deployment -------------------------------------------------------------------------------


def engine_spec(cluster: Cluster, placement: dict, prefill: int, cache: int = 0) -> dict:
    """An InferenceDeployment spec whose engine pools run on CPU where `placement` puts them."""
    engine = {"resources": {"gpus": 0}, **placement}
    return {
        "model": {"name": MODEL, "dtype": DTYPE},
        "image": IMAGE,
        "imagePullPolicy": "Never" if cluster.local else "IfNotPresent",
        "prefill": {"replicas": prefill, **engine},
        "decode": {"replicas": 1, **engine},
        "cache": {"replicas": cache},
        "router": {"replicas": 1, **placement},
    }


def ready_pods(cluster: Cluster, ns: str, name: str, component: str) -> list:
    """The component's pods that are Ready and not being deleted."""
    pods = cluster.core.list_namespaced_pod(
        ns, label_selector=f"app.kubernetes.io/instance={name},app.kubernetes.io/component={component}")
    return [p for p in pods.items if p.metadata.deletion_timestamp is None and any(
        c.type == "Ready" and c.status == "True" for c in p.status.conditions or ())]


def deploy(cluster: Cluster, ns: str, name: str, spec: dict, timeout: float = 900) -> None:
    """Create the CR and wait until every pool with replicas has its pods Ready."""
    cluster.create_cr(ns, name, spec)
    pools = [c for c in ("prefill", "decode", "cache", "router") if spec[c]["replicas"] > 0]

    def all_ready():
        return all(len(ready_pods(cluster, ns, name, c)) == spec[c]["replicas"] for c in pools)

    try:
        wait_until(f"{', '.join(pools)} pods Ready", all_ready, timeout=timeout, every=2)
    except AssertionError:
        print(cluster.kubectl("-n", ns, "get", "pods", "-o", "wide", check=False).stdout)
        for c in pools:
            print(cluster.kubectl("-n", ns, "logs", "--tail=40", f"deploy/{name}-{c}",
                                  check=False).stdout)
        raise


@contextmanager
def router_port_forward(cluster: Cluster, ns: str, name: str) -> Iterator[str]:
    """`kubectl port-forward svc/<name>-router` (the path that also works on kind); yields the URL."""
    with port_forward(cluster, ns, f"svc/{name}-router", "/ready") as url:
        yield url


@contextmanager
def port_forward(cluster: Cluster, ns: str, target: str, ready_path: str = "/health") -> Iterator[str]:
    """`kubectl port-forward <target> PORT:8000` until ``ready_path`` answers 200; yields the URL."""
    port = free_port()
    proc = subprocess.Popen(["kubectl", "-n", ns, "port-forward", target,
                             f"{port}:8000", "--address", "127.0.0.1"], env=cluster.env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return httpx.get(f"{url}{ready_path}", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(f"{target} reachable through port-forward", healthy, timeout=120, every=1)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def internal_token(cluster: Cluster, ns: str, name: str) -> str:
    """The deployment's internal token, from the Secret the operator created (`<name>-auth`)."""
    import base64

    from kubernetes import client as k8s

    secret = k8s.CoreV1Api(cluster.api).read_namespaced_secret(f"{name}-auth", ns)
    return base64.b64decode(secret.data["token"]).decode().strip()


@contextmanager
def _pod_url(cluster: Cluster, ns: str, pod: str) -> Iterator[str]:
    """The pod's HTTP port as this host reaches it: its IP on the local real node, else a port-forward."""
    if cluster.real_node:
        yield f"http://{cluster.core.read_namespaced_pod(pod, ns).status.pod_ip}:8000"
        return
    with port_forward(cluster, ns, f"pod/{pod}") as url:
        yield url


def pod_internal_get(cluster: Cluster, ns: str, name: str, pod: str, path: str) -> str:
    """GET an internal endpoint (/kv/*, /admin/*) of one pod with the deployment's token (not
    through the API server's pod proxy: it drops the Authorization header it consumed). Checks on
    the way that the pod refuses the same request without the token."""
    token = internal_token(cluster, ns, name)
    with _pod_url(cluster, ns, pod) as url:
        assert httpx.get(url + path, timeout=30).status_code == 401, f"{path} on {pod} answered without the token"
        r = httpx.get(url + path, headers={"Authorization": f"Bearer {token}"}, timeout=30)
    assert r.status_code == 200, f"GET {path} on pod {pod}: HTTP {r.status_code}: {r.text[:2000]}"
    return r.text


def _pod_proxy(cluster: Cluster, method: str, ns: str, pod: str, path: str, body: dict | None = None) -> bytes:
    """A request to a pod's HTTP port through the API server's pod proxy (also works on kind,
    whose pod IPs the host cannot reach); an HTTP error fails with the pod's own answer."""
    conf = cluster.api.configuration
    headers = {"Accept": "application/json", **({"Content-Type": "application/json"} if body else {})}
    headers.update({a["key"]: a["value"] for a in conf.auth_settings().values() if a["in"] == "header"})
    url = f"{conf.host}/api/v1/namespaces/{ns}/pods/{pod}:8000/proxy{path}"
    resp = cluster.api.rest_client.request(method, url, headers=headers, body=body, _request_timeout=600)
    data = resp.read()
    assert resp.status == 200, f"{method} {path} on pod {pod}: HTTP {resp.status}: {data[:2000]!r}"
    return data


def pod_get(cluster: Cluster, ns: str, pod: str, path: str) -> str:
    return _pod_proxy(cluster, "GET", ns, pod, path).decode()


def pod_chat(cluster: Cluster, ns: str, pod: str, question: str, max_tokens: int = MAX_TOKENS) -> Any:
    """A greedy chat completion sent to one engine pod, bypassing the router."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            **{k: v for k, v in GREEDY.items() if k != "extra_body"}, **GREEDY["extra_body"]}
    data = _pod_proxy(cluster, "POST", ns, pod, "/v1/chat/completions", body)
    return ChatCompletion.model_validate_json(data)


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (0 when there are none)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)


# ---- the reference --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reference:
    prompt_ids: list[int]
    token_ids: list[int]
    tokens: list[str]  # each id decoded on its own, as the server's logprobs show it
    text: str  # what the server's message content must be
    logits: Any  # [steps, vocab], transformers' own


class HFReference:
    """transformers' fp32 greedy generation from the default model's GGUF, one prompt at a time,
    on the chat prompt the engine's tokenizer renders (what the server does with a chat request)."""

    def __init__(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from kvmesh.engine.model.fetch import ensure_default_model
        from kvmesh.engine.model.tokenizer import Tokenizer

        path = ensure_default_model(progress=False)
        self.tokenizer = Tokenizer.from_gguf(path)
        self.model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                          dtype=torch.float32)
        self.model.eval()
        self.model.generation_config.eos_token_id = None  # the full length, as ignore_eos does

    @functools.lru_cache(maxsize=None)
    def greedy(self, question: str, max_new: int) -> Reference:
        import torch

        ids = self.tokenizer.apply_chat_template([{"role": "user", "content": question}])
        with torch.inference_mode():
            # An explicit mask: the prompt contains <|im_end|>, which is also the pad id.
            x = torch.tensor([ids])
            out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new,
                                      do_sample=False, output_logits=True,
                                      return_dict_in_generate=True, pad_token_id=2)
        toks = out.sequences[0, len(ids):].tolist()
        return Reference(ids, toks, [self.tokenizer.decode([t], skip_special_tokens=False) for t in toks],
                         self.tokenizer.decode(toks, skip_special_tokens=True),
                         torch.stack([step[0] for step in out.logits]))


def check_tokens(ref: Reference, tokens: list[str], text: str, where: str) -> int:
    """Assert the server's tokens are the reference's up to near ties; returns the near ties (0 or 1)."""
    assert len(tokens) == len(ref.token_ids), f"{where}: {len(tokens)} tokens, want {len(ref.token_ids)}"
    for j, (got, want) in enumerate(zip(tokens, ref.tokens)):
        if got == want:
            continue
        top2 = ref.logits[j].topk(2).values
        margin = float(top2[0] - top2[1])
        assert margin < NEAR_TIE, (
            f"{where}: token {j} is {got!r}, transformers' is {want!r}, whose top-2 margin "
            f"{margin:.2e} is not a near tie\nserver: {tokens}\nhf:     {ref.tokens}")
        print(f"\n{where}: near tie at token {j} (margin {margin:.2e}): {got!r} vs {want!r}")
        return 1
    assert text == ref.text, where
    return 0


def check_completion(hf: HFReference, question: str, max_tokens: int, r: Any, where: str = "") -> Any:
    """A greedy chat completion (`ChatCompletion`) checked against the reference; returns it."""
    ref = hf.greedy(question, max_tokens)
    assert r.usage.prompt_tokens == len(ref.prompt_ids)  # the same chat prompt
    assert r.usage.completion_tokens == max_tokens
    check_tokens(ref, [t.token for t in r.choices[0].logprobs.content], r.choices[0].message.content,
                 f"{where}{question!r}")
    return r


def chat_matches_reference(url: str, hf: HFReference, question: str, max_tokens: int = MAX_TOKENS,
                           where: str = "") -> Any:
    """One chat completion through the router, checked against the reference; returns the response."""
    r = client(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                            max_tokens=max_tokens, **GREEDY)
    return check_completion(hf, question, max_tokens, r, where)


# ---- streams in flight ----------------------------------------------------------------------------


class Stream(threading.Thread):
    """A streamed greedy chat completion through `url`, read on its own thread.

    `first` is set once the first chunk arrived (or the stream failed); after `join`, `outcome`
    holds {"text", "tokens"} for a stream that ended normally, or {"error"}."""

    def __init__(self, url: str, question: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.question, self.max_tokens = url, question, max_tokens
        self.first = threading.Event()
        self.outcome: dict = {}

    def run(self) -> None:
        try:
            chunks = client(self.url).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": self.question}],
                max_tokens=self.max_tokens, stream=True, **GREEDY)
            text, tokens = "", []
            for chunk in chunks:
                self.first.set()
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    if chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
                        tokens += [t.token for t in chunk.choices[0].logprobs.content]
            self.outcome = {"text": text, "tokens": tokens}
        except (openai.APIError, httpx.HTTPError) as exc:
            self.outcome = {"error": exc}
        finally:
            self.first.set()

    def started(self, timeout: float = 300) -> "Stream":
        """Start and wait for the first chunk."""
        self.start()
        assert self.first.wait(timeout), f"no first token for {self.question!r} within {timeout}s"
        assert "error" not in self.outcome, f"{self.question!r}: {self.outcome['error']!r}"
        return self

    def finished(self, timeout: float = 600) -> dict:
        self.join(timeout)
        assert not self.is_alive(), f"the stream for {self.question!r} hung"
        return self.outcome

    def check_complete(self, hf: HFReference, where: str) -> None:
        """The stream ended normally with the whole greedy answer."""
        assert "text" in self.outcome, f"{where}: the stream failed: {self.outcome.get('error')!r}"
        check_tokens(hf.greedy(self.question, self.max_tokens), self.outcome["tokens"],
                     self.outcome["text"], where)


def stream_while_deleting(cluster: Cluster, ns: str, victim: str, url: str, hf: HFReference) -> dict:
    """Stream STORY through the router and delete pod `victim` once the first token arrived.

    The stream must end cleanly: a complete answer (the engine drains what it admitted on SIGTERM),
    which must then be the reference's, or an error, never a hang. Returns {"text"|"error": ...}."""
    stream = Stream(url, STORY, STORY_TOKENS)
    stream.start()
    assert stream.first.wait(300), "no first token"
    cluster.core.delete_namespaced_pod(victim, ns)
    outcome = stream.finished()
    assert "text" in outcome or "error" in outcome
    print(f"\nstream after pod {victim} was deleted: "
          f"{'complete answer' if 'text' in outcome else repr(outcome['error'])}")
    if "text" in outcome:  # drained or retried: then it must be the whole greedy answer
        stream.check_complete(hf, "the stream whose pod was deleted")
    return outcome


def wait_for_replacement(cluster: Cluster, ns: str, name: str, component: str, victim: str) -> Any:
    return wait_until(f"a replacement {component} pod Ready", lambda: [
        p for p in ready_pods(cluster, ns, name, component) if p.metadata.name != victim],
        timeout=900, every=2)[0]


def answered_later(url: str, hf: HFReference, question: str, timeout: float = 180) -> Any:
    """The first successful chat completion within `timeout` (the router may still be catching up
    with the replaced pod), checked against the reference."""

    def answered():
        try:
            return chat_matches_reference(url, hf, question, where="after the replacement: ")
        except openai.APIError:
            return None

    return wait_until("a request through the router to succeed", answered, timeout=timeout, every=2)
