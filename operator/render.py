"""InferenceDeployment -> child manifests (pure functions, no I/O).

One CR renders to exactly ten objects, always the same set whatever the
spec (a pool scaled to zero keeps its Deployment at 0 replicas), so the
operator never has to decide what to delete: the garbage collector removes
children through their ownerReferences when the CR goes.

    <name>-config     ConfigMap: the engine configuration file (kvmesh.yaml)
    <name>-prefill    Deployment + headless Service   (`kvmesh serve --role prefill`)
    <name>-decode     Deployment + headless Service   (`kvmesh serve --role decode|both`)
    <name>-cache      Deployment + headless Service   (`kvmesh cache-node`)
    <name>-router     Deployment + ClusterIP Service  (`kvmesh router`)
    <name>-internal   NetworkPolicy: engine and cache pods take traffic only from the
                      deployment's own pods, the operator and labelled scrapers

Every pod meets the "restricted" Pod Security Standard (non-root, no privilege escalation, no
capabilities, RuntimeDefault seccomp, no service-account token; a read-only root filesystem for
the router and cache nodes, whose processes write nothing; engines write their compiled CPU
kernels beside the model).

Invariants: rendering is deterministic (same input, byte-identical output),
so server-side apply of the result is a no-op when nothing changed; a pool's
pod template changes only when something that pool consumes changes (its own
spec section, or the part of the configuration file it reads, tracked by a
per-pool hash annotation), so editing one pool never restarts another.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

import yaml

from kvmesh.engine.util import fleet_args as fa

from . import spec as s
from .autoscaler import autoscaled_pools, effective_replicas
from .gateway import EXT_PROC_PORT, EXT_PROC_PORT_NAME, render_gateway_objects, serving_component
from .owner import MANAGED_BY, OWNER_LABEL, Owner, child_name, labels, meta as _meta, selector_labels
from .quantity import add_bytes, format_bytes, parse_quantity

ENGINE_PORT = 8000
# KV event stream of every engine (ZeroMQ PUB; replay requests on the next port). 5557 is the
# port vLLM's KV event publisher documents, so third-party routers find it where they expect.
KV_EVENTS_PORT = 5557
# A cache node's UCX listener (block transfers); engines find it in the node's /kv/info.
CACHE_UCX_PORT = ENGINE_PORT + 1
# A disaggregated decode engine's UCX listener, where prefill engines push KV; the router reads it
# from the engine's /kv/info and hands it to the prefill engine. ENGINE_PORT + 1 is free in engine
# pods (the cache node's UCX port is the same number, in other pods).
KV_TRANSFER_PORT = ENGINE_PORT + 1
CONFIG_DIR = "/etc/kvmesh"
CONFIG_FILE = "kvmesh.yaml"
# The deployment's internal token (a Secret the operator creates once, never renders: rendering is
# pure and a token must be random); mounted into every pod, named by --auth-token-file.
AUTH_DIR = "/var/run/kvmesh/auth"
AUTH_KEY = "token"
AUTH_TOKEN_FILE = f"{AUTH_DIR}/{AUTH_KEY}"
# The user's client keys (spec.auth.apiKeysSecret), mounted into router pods only.
API_KEYS_DIR = "/var/run/kvmesh/api-keys"
API_KEYS_FILE = f"{API_KEYS_DIR}/keys"
MODEL_DIR = "/models"
GPU_RESOURCE = "nvidia.com/gpu"
# Host memory a cache node needs beyond its KV capacity (process, buffers).
CACHE_OVERHEAD = "1Gi"
# Seconds of a pod's grace period kept after the engine's drain timeout: the
# abort of leftovers (5 s for their final chunks) and the server's shutdown.
DRAIN_MARGIN_S = 10
CONFIG_HASH_ANNOTATION = "serving.kvmesh.io/config-hash"
# The image's non-root user (images/Dockerfile); the restricted standard wants it stated.
RUN_AS = 1000
# Pods in a namespace with this label may reach engine and cache pods (Prometheus scraping
# /metrics, which shares the HTTP port with the internal endpoints).
SCRAPER_NAMESPACE_LABEL = "serving.kvmesh.io/metrics-scraper"
# The operator's pods as the chart labels them (charts/kvmesh/templates/_helpers.tpl).
OPERATOR_POD_LABELS = {"app.kubernetes.io/name": "kvmesh", "app.kubernetes.io/component": "operator"}
GPU_TOLERATION = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
# Which sections of the configuration file each pool reads: the per-pool
# config hash covers only these, so e.g. an SLO edit restarts the router only.
CONFIG_SECTIONS = {
    "prefill": ("model", "services"),
    "decode": ("model", "services"),
    "cache": ("cache",),
    "router": ("model", "services", "router", "slo"),
}


def auth_secret_name(owner: Owner) -> str:
    return f"{owner.name}-auth"


def render_auth_secret(owner: Owner, token: str) -> dict[str, Any]:
    """The Secret holding the deployment's internal token (created when absent, never replaced:
    rotate it by editing the Secret; the pods re-read the mounted file)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(owner, auth_secret_name(owner), None),
        "type": "Opaque",
        "stringData": {AUTH_KEY: token},
    }


def config_name(owner: Owner) -> str:
    return f"{owner.name}-config"


def service_host(owner: Owner, component: str) -> str:
    return f"{child_name(owner, component)}.{owner.namespace}.svc"


def router_url(owner: Owner) -> str:
    return f"http://{service_host(owner, 'router')}:{ENGINE_PORT}"


def _endpoint(owner: Owner, component: str) -> str:
    return f"{service_host(owner, component)}:{ENGINE_PORT}"


def engine_config(spec: s.InferenceSpec, owner: Owner) -> dict[str, Any]:
    """Content of kvmesh.yaml: what the pools read beyond their arguments."""
    m = spec.model
    source: dict[str, Any] = {"type": m.source_type}
    if m.source_type == "Volume":
        source["path"] = _model_path(spec)
    if m.source_type == "URI":
        source["uri"] = m.uri
    services = {"decode": _endpoint(owner, "decode"), "router": _endpoint(owner, "router")}
    if not spec.colocated:
        services["prefill"] = _endpoint(owner, "prefill")
    if spec.cache.replicas > 0:
        services["cache"] = _endpoint(owner, "cache")
    a = spec.autoscaling
    return {
        "model": {"name": m.name, "format": m.format, "source": source},
        "services": services,
        "cache": {"memory": spec.cache.memory},
        "router": {"policy": spec.router.policy},
        "slo": {
            "ttftMs": spec.slo.ttft_ms,
            "tpotMs": spec.slo.tpot_ms,
            "percentile": spec.slo.percentile,
        },
        "autoscaling": {
            "enabled": a.enabled,
            "kvOccupancyTarget": a.kv_occupancy_target,
            "scaleUpStabilizationSeconds": a.scale_up_stabilization_seconds,
            "scaleDownStabilizationSeconds": a.scale_down_stabilization_seconds,
            "metricsWindowSeconds": a.metrics_window_seconds,
            # The bounds of each pool the autoscaler resizes, as given (null: the
            # pool's replicas, see autoscaler.bounds), so that a scale leaves
            # this file unchanged.
            "pools": {c: {"minReplicas": spec.component(c).min_replicas,
                          "maxReplicas": spec.component(c).max_replicas}
                      for c in autoscaled_pools(spec)},
        },
    }


def config_hash(config: Mapping[str, Any], component: str) -> str:
    view = {k: config[k] for k in CONFIG_SECTIONS[component]}
    return hashlib.sha256(json.dumps(view, sort_keys=True).encode()).hexdigest()[:16]


def _model_path(spec: s.InferenceSpec) -> str:
    vol = spec.model.volume
    return f"{MODEL_DIR}/{vol.path}" if vol and vol.path else MODEL_DIR


def drain_timeout_s(c: s.Component) -> int:
    """The engine's drain bound from the pod's grace period: the kubelet kills the
    container at terminationGracePeriodSeconds, so the engine must have aborted
    its leftovers and sent their final chunks (DRAIN_MARGIN_S) before then."""
    return max(1, c.termination_grace_period_seconds - DRAIN_MARGIN_S)


def component_args(spec: s.InferenceSpec, owner: Owner, component: str) -> list[str]:
    """The `kvmesh ...` command line a pool's container runs (engine/util/fleet_args.py renders
    it, as for `kvmesh up`)."""
    common = {"host": "0.0.0.0", "port": ENGINE_PORT, "config": f"{CONFIG_DIR}/{CONFIG_FILE}",
              "auth_token_file": AUTH_TOKEN_FILE}
    cache = _endpoint(owner, "cache") if spec.cache.replicas > 0 else None
    if component in ("prefill", "decode"):
        role = "both" if component == "decode" and spec.colocated else component
        line = fa.EngineLine(
            api_key_files=(API_KEYS_FILE,) if _client_keys_mounted(spec, component) else (),
            role=role, model=spec.model.name,
            model_path=_model_path(spec) if spec.model.source_type == "Volume" else None,
            model_uri=str(spec.model.uri) if spec.model.source_type == "URI" else None,
            model_format=spec.model.format.lower() if spec.model.format != "Auto" else None,
            # Always given, default included: the pods run what the CR says whatever the engine's
            # default. Only the engine pools read it (not kvmesh.yaml), so a change rolls only them.
            dtype=spec.model.dtype, cache_node=cache, kv_events_port=KV_EVENTS_PORT,
            state_checkpoint_interval=spec.model.state_checkpoint_interval,
            state_checkpoint_bytes=int(parse_quantity(spec.model.state_checkpoint_memory)),
            **fa.admission_fields(spec.slo.admission, spec.slo.ttft_ms, spec.slo.tpot_ms),
            kv_transfer_port=KV_TRANSFER_PORT if role == "decode" else None,
            drain_timeout_s=drain_timeout_s(spec.component(component)), **common)
        return ["kvmesh", *fa.serve_args(line)]
    if component == "cache":
        return ["kvmesh", *fa.cache_node_args(fa.CacheNodeLine(str(spec.cache.memory), ucx_port=CACHE_UCX_PORT,
                                                               **common))]
    if component == "router":
        prefill = None if spec.colocated else fa.Pool(service=_endpoint(owner, "prefill"))
        keys = (API_KEYS_FILE,) if spec.auth.api_keys_secret else ()
        return ["kvmesh", *fa.router_args(fa.RouterLine(
            decode=fa.Pool(service=_endpoint(owner, "decode")), prefill=prefill, policy=str(spec.router.policy),
            model=spec.model.name, cache_node=cache, api_key_files=keys, isolate_tenants=spec.auth.isolate_tenants,
            ext_proc_port=EXT_PROC_PORT if spec.gateway.enabled else None, **common))]
    raise ValueError(f"unknown component {component!r}; expected one of {s.COMPONENTS}")


def _client_keys_mounted(spec: s.InferenceSpec, component: str) -> bool:
    """Where clients' requests arrive, the client keys are checked: the router in proxy mode, the
    serving engines behind a gateway (which sends requests to them directly)."""
    if not spec.auth.api_keys_secret:
        return False
    if spec.gateway.enabled:
        return component in ("router", serving_component(spec))
    return component == "router"


def _resources(c: s.Component) -> dict[str, Any]:
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if c.resources.cpu is not None:
        requests["cpu"] = str(c.resources.cpu)
    memory = c.resources.memory
    if c.name == "cache":
        # A cache node must be able to hold its whole KV capacity.
        floor = add_bytes(str(c.memory), CACHE_OVERHEAD)
        if memory is None or parse_quantity(memory) < parse_quantity(floor):
            memory = floor
    if memory is not None:
        memory = format_bytes(parse_quantity(memory))
        requests["memory"] = memory
        limits["memory"] = memory
    if c.resources.gpus > 0:
        limits[GPU_RESOURCE] = str(c.resources.gpus)
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _tolerations(c: s.Component) -> list[dict[str, Any]]:
    out = [t.to_manifest() for t in c.tolerations]
    if c.resources.gpus > 0 and GPU_TOLERATION not in out:
        out.append(dict(GPU_TOLERATION))
    return out


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 2,
        "failureThreshold": failures,
    }


def _env(owner: Owner, component: str) -> list[dict[str, Any]]:
    def field(path: str) -> dict[str, Any]:
        return {"valueFrom": {"fieldRef": {"fieldPath": path}}}

    return [
        {"name": "KVMESH_POD_NAME", **field("metadata.name")},
        {"name": "KVMESH_POD_NAMESPACE", **field("metadata.namespace")},
        {"name": "KVMESH_POD_IP", **field("status.podIP")},
        {"name": "KVMESH_NODE_NAME", **field("spec.nodeName")},
        {"name": "KVMESH_DEPLOYMENT", "value": owner.name},
        {"name": "KVMESH_COMPONENT", "value": component},
    ]


def _receives_kv(spec: s.InferenceSpec, component: str) -> bool:
    """The decode pool of a disaggregated deployment: its engines listen for KV transfers."""
    return component == "decode" and not spec.colocated


def _container_ports(spec: s.InferenceSpec, component: str) -> list[dict[str, Any]]:
    ports = [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}]
    if component in ("prefill", "decode"):
        ports += [{"name": "kv-events", "containerPort": KV_EVENTS_PORT, "protocol": "TCP"},
                  {"name": "kv-replay", "containerPort": KV_EVENTS_PORT + 1, "protocol": "TCP"}]
    if _receives_kv(spec, component):
        ports.append({"name": "kv-transfer", "containerPort": KV_TRANSFER_PORT, "protocol": "TCP"})
    if component == "cache":
        ports.append({"name": "ucx", "containerPort": CACHE_UCX_PORT, "protocol": "TCP"})
    if component == "router" and spec.gateway.enabled:
        ports.append({"name": EXT_PROC_PORT_NAME, "containerPort": EXT_PROC_PORT, "protocol": "TCP"})
    return ports


def render_deployment(
    spec: s.InferenceSpec, owner: Owner, component: str, config: Mapping[str, Any],
    replicas: int | None = None,
) -> dict[str, Any]:
    """`replicas` overrides the spec's (the autoscaler's choice, autoscaler.effective_replicas)."""
    c = spec.component(component)
    engine = component in ("prefill", "decode")
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": config_name(owner)}},
        {"name": "auth", "secret": {"secretName": auth_secret_name(owner), "items": [{"key": AUTH_KEY, "path": AUTH_KEY}]}},
    ]
    mounts: list[dict[str, Any]] = [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                                    {"name": "auth", "mountPath": AUTH_DIR, "readOnly": True}]
    if _client_keys_mounted(spec, component):
        volumes.append({"name": "api-keys", "secret": {
            "secretName": spec.auth.api_keys_secret, "items": [{"key": spec.auth.api_keys_key, "path": "keys"}]}})
        mounts.append({"name": "api-keys", "mountPath": API_KEYS_DIR, "readOnly": True})
    if not engine:
        # A read-only root filesystem; /tmp stays writable for whatever a library wants there.
        volumes.append({"name": "tmp", "emptyDir": {"sizeLimit": "256Mi"}})
        mounts.append({"name": "tmp", "mountPath": "/tmp"})
    if engine:
        # torch's inter-process tensors live in /dev/shm, which defaults to 64Mi.
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
        vol = spec.model.volume
        if spec.model.source_type == "Volume" and vol is not None:
            source: dict[str, Any] = (
                {"persistentVolumeClaim": {"claimName": vol.claim_name, "readOnly": True}}
                if vol.claim_name
                else {"hostPath": {"path": vol.host_path, "type": "Directory"}}
            )
            volumes.append({"name": "model", **source})
            mounts.append({"name": "model", "mountPath": MODEL_DIR, "readOnly": True})
    argv = component_args(spec, owner, component)
    container = {
        "name": component,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        # `command` rather than args alone: works whatever the image's ENTRYPOINT.
        "command": argv[:1],
        "args": argv[1:],
        "ports": _container_ports(spec, component),
        "env": _env(owner, component),
        "resources": _resources(c),
        "volumeMounts": mounts,
        # Loading weights can take minutes; liveness only starts once /health answers.
        "startupProbe": _probe("/health", 10, 90 if engine else 30),
        "livenessProbe": _probe("/health", 10, 3),
        "readinessProbe": _probe("/ready", 5, 3),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": not engine,
            "runAsNonRoot": True,
        },
    }
    pod_spec: dict[str, Any] = {
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS,
            "runAsGroup": RUN_AS,
            "fsGroup": RUN_AS,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": c.termination_grace_period_seconds,
        "enableServiceLinks": False,
        # The data plane never talks to the Kubernetes API.
        "automountServiceAccountToken": False,
    }
    if c.node_selector:
        pod_spec["nodeSelector"] = dict(sorted(c.node_selector.items()))
    tolerations = _tolerations(c)
    if tolerations:
        pod_spec["tolerations"] = tolerations
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(owner, child_name(owner, component), component),
        "spec": {
            "replicas": c.replicas if replicas is None else replicas,
            "revisionHistoryLimit": 3,
            "selector": {"matchLabels": selector_labels(owner, component)},
            # Keep serving capacity during a rollout: add the new pod first.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "template": {
                "metadata": {
                    "labels": labels(owner, component),
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(ENGINE_PORT),
                        "prometheus.io/path": "/metrics",
                        CONFIG_HASH_ANNOTATION: config_hash(config, component),
                    },
                },
                "spec": pod_spec,
            },
        },
    }


def render_service(spec: s.InferenceSpec, owner: Owner, component: str) -> dict[str, Any]:
    """Headless for engine pools and cache nodes (the router resolves pod IPs),
    ClusterIP for the router (the stable entry point). Besides HTTP, a Service lists the
    ports peers dial on its pods: a cache node's UCX port, a decode engine's KV transfer port."""
    svc_spec: dict[str, Any] = {
        "selector": selector_labels(owner, component),
        "ports": [{"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}],
    }
    if component == "cache":
        svc_spec["ports"].append({"name": "ucx", "port": CACHE_UCX_PORT, "targetPort": "ucx", "protocol": "TCP"})
    if _receives_kv(spec, component):
        svc_spec["ports"].append({"name": "kv-transfer", "port": KV_TRANSFER_PORT, "targetPort": "kv-transfer",
                                  "protocol": "TCP"})
    if component == "router" and spec.gateway.enabled:
        # The InferencePool's endpointPickerRef names this Service and port.
        svc_spec["ports"].append({"name": EXT_PROC_PORT_NAME, "port": EXT_PROC_PORT, "targetPort": EXT_PROC_PORT_NAME,
                                  "protocol": "TCP", "appProtocol": "kubernetes.io/h2c"})
    if component == "router":
        svc_spec["type"] = "ClusterIP"
    else:
        svc_spec["clusterIP"] = "None"
        svc_spec["publishNotReadyAddresses"] = False
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(owner, child_name(owner, component), component),
        "spec": svc_spec,
    }


def network_policy_name(owner: Owner) -> str:
    return child_name(owner, "internal")


def render_network_policy(spec: s.InferenceSpec, owner: Owner) -> dict[str, Any]:
    """Engine and cache pods accept connections only from the deployment's own pods (the router,
    engines and cache nodes among themselves), the operator (drains, scale decisions) and pods in
    namespaces labelled ``SCRAPER_NAMESPACE_LABEL=true``. The router stays open: it is the entry
    point. Behind a gateway (spec.router.mode gateway) the engines' HTTP port is an entry point too,
    open to any source: the gateway's Envoy runs wherever its installation put it (their internal
    endpoints still need the token; UCX and KV-event ports stay closed). Enforcement needs a CNI that implements NetworkPolicy; elsewhere it is inert."""
    internal = [c for c in s.COMPONENTS if c != "router"]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(owner, network_policy_name(owner), None),
        "spec": {
            "podSelector": {
                "matchLabels": {OWNER_LABEL: owner.name},
                "matchExpressions": [{"key": "app.kubernetes.io/component", "operator": "In", "values": internal}],
            },
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [
                {"podSelector": {"matchLabels": {OWNER_LABEL: owner.name}}},
                {"namespaceSelector": {}, "podSelector": {"matchLabels": dict(OPERATOR_POD_LABELS)}},
                {"namespaceSelector": {"matchLabels": {SCRAPER_NAMESPACE_LABEL: "true"}}},
            ]}] + ([{"ports": [{"port": ENGINE_PORT, "protocol": "TCP"}]}] if spec.gateway.enabled else []),
        },
    }


def render_configmap(owner: Owner, config: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(owner, config_name(owner), None),
        "data": {CONFIG_FILE: yaml.safe_dump(dict(config), sort_keys=True)},
    }


def render_all(obj: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every child of one InferenceDeployment object (raises spec.SpecError)."""
    owner = Owner.from_object(obj)
    spec = s.parse_spec(obj.get("spec") or {})
    config = engine_config(spec, owner)
    replicas = effective_replicas(spec, obj.get("status"))
    out = [render_configmap(owner, config)]
    for component in s.COMPONENTS:
        out.append(render_deployment(spec, owner, component, config, replicas[component]))
        out.append(render_service(spec, owner, component))
    out.append(render_network_policy(spec, owner))
    return out + render_gateway_objects(spec, owner, ENGINE_PORT)
