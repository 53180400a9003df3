"""The operator's only contact with the Kubernetes API (kubernetes client).

Every write is a server-side apply under one field manager, with `force` so
that the operator takes back fields someone edited by hand. Apply is
idempotent on the server: applying an unchanged manifest writes nothing and
emits no watch event, which is what keeps reconciliation level-based without
a client-side diff.
"""

from __future__ import annotations

import json
import threading
from datetime import datetime, timezone
from typing import Any, Mapping

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from . import spec as s
from .gateway import RESOURCES as GATEWAY_RESOURCES
from .gateway import POOL_KIND, ROUTE_KIND, ObjectRef
from .render import AUTH_KEY, MANAGED_BY, OWNER_LABEL

FIELD_MANAGER = MANAGED_BY
APPLY = "application/apply-patch+yaml"
MERGE = "application/merge-patch+json"

_lock = threading.Lock()
_api: client.ApiClient | None = None


def load_config() -> None:
    """Kubeconfig from $KUBECONFIG / ~/.kube/config, else the in-cluster account."""
    try:
        config.load_kube_config()
    except config.ConfigException:
        config.load_incluster_config()


def api_client() -> client.ApiClient:
    global _api
    with _lock:
        if _api is None:
            load_config()
            _api = client.ApiClient()
        return _api


class ApplyError(RuntimeError):
    """The API server refused a child; the message says which and why."""


def _reason(exc: ApiException) -> str:
    try:
        return json.loads(exc.body or "{}").get("message") or str(exc.reason)
    except ValueError:
        return str(exc.reason)


def apply(manifest: Mapping[str, Any]) -> None:
    """Server-side apply one namespaced child (ConfigMap, Service, Deployment or NetworkPolicy)."""
    kind = manifest["kind"]
    meta = manifest["metadata"]
    kwargs = dict(field_manager=FIELD_MANAGER, force=True, _content_type=APPLY)
    api = api_client()
    try:
        if kind == "Deployment":
            client.AppsV1Api(api).patch_namespaced_deployment(
                meta["name"], meta["namespace"], manifest, **kwargs
            )
        elif kind == "Service":
            client.CoreV1Api(api).patch_namespaced_service(
                meta["name"], meta["namespace"], manifest, **kwargs
            )
        elif kind == "ConfigMap":
            client.CoreV1Api(api).patch_namespaced_config_map(
                meta["name"], meta["namespace"], manifest, **kwargs
            )
        elif kind == "NetworkPolicy":
            client.NetworkingV1Api(api).patch_namespaced_network_policy(
                meta["name"], meta["namespace"], manifest, **kwargs
            )
        elif kind in (POOL_KIND, ROUTE_KIND):
            group, version, plural = GATEWAY_RESOURCES[kind]
            client.CustomObjectsApi(api).patch_namespaced_custom_object(
                group, version, meta["namespace"], plural, meta["name"], manifest, **kwargs
            )
        else:
            raise ValueError(f"the operator does not manage {kind} objects")
    except ApiException as exc:
        if exc.status == 404 and kind in (POOL_KIND, ROUTE_KIND):
            group, version, plural = GATEWAY_RESOURCES[kind]
            raise ApplyError(f"{kind} {meta['name']}: this cluster does not serve {plural}.{group}/{version}; "
                             "install the Gateway API Inference Extension CRDs (and, for an HTTPRoute, the Gateway "
                             "API CRDs), or set spec.router.mode to proxy") from exc
        raise ApplyError(f"{kind} {meta['name']}: {_reason(exc)}") from exc


def delete_owned(ref: ObjectRef, owner_uid: str) -> None:
    """Delete an optional child (gateway.stale_refs) if it exists and ``owner_uid`` controls it.

    An absent object, or an API that does not serve its kind (no GIE CRDs installed), is what the
    pass wants already; an object of the same name that someone else owns is left alone."""
    group, version, plural = GATEWAY_RESOURCES[ref.kind]
    api = client.CustomObjectsApi(api_client())
    try:
        obj = api.get_namespaced_custom_object(group, version, ref.namespace, plural, ref.name)
        owners = (obj.get("metadata") or {}).get("ownerReferences") or ()
        if not any(o.get("uid") == owner_uid and o.get("controller") for o in owners):
            return
        api.delete_namespaced_custom_object(group, version, ref.namespace, plural, ref.name)
    except ApiException as exc:
        if exc.status != 404:
            raise ApplyError(f"{ref.kind} {ref.name}: delete failed: {_reason(exc)}") from exc


def create_if_absent(manifest: Mapping[str, Any]) -> None:
    """Create a namespaced Secret unless one of its name exists (a token is never replaced)."""
    meta = manifest["metadata"]
    if manifest["kind"] != "Secret":
        raise ValueError(f"create_if_absent creates Secrets only, not {manifest['kind']}")
    try:
        client.CoreV1Api(api_client()).create_namespaced_secret(meta["namespace"], manifest,
                                                                 field_manager=FIELD_MANAGER)
    except ApiException as exc:
        if exc.status != 409:  # AlreadyExists: the token stays as it is
            raise ApplyError(f"Secret {meta['name']}: {_reason(exc)}") from exc


def auth_token(namespace: str, owner_name: str) -> str | None:
    """The deployment's internal token from its Secret (None when it is not there yet)."""
    import base64

    name = f"{owner_name}-auth"  # render.auth_secret_name
    try:
        secret = client.CoreV1Api(api_client()).read_namespaced_secret(name, namespace)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    raw = (secret.data or {}).get(AUTH_KEY)
    return base64.b64decode(raw).decode().strip() if raw else None


def get_inference_deployment(namespace: str, name: str) -> dict[str, Any] | None:
    try:
        return client.CustomObjectsApi(api_client()).get_namespaced_custom_object(
            s.GROUP, s.VERSION, namespace, s.PLURAL, name
        )
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def list_inference_deployments(namespace: str | None) -> list[dict[str, Any]]:
    api = client.CustomObjectsApi(api_client())
    if namespace:
        items = api.list_namespaced_custom_object(s.GROUP, s.VERSION, namespace, s.PLURAL)
    else:
        items = api.list_cluster_custom_object(s.GROUP, s.VERSION, s.PLURAL)
    return list(items.get("items", []))


def child_deployments(namespace: str, owner_name: str, owner_uid: str) -> dict[str, dict]:
    """The owner's Deployments by component, as plain dicts.

    Filtered on the ownerReference uid too, so a CR deleted and re-created
    under the same name never reads its predecessor's children.
    """
    api = api_client()
    listing = client.AppsV1Api(api).list_namespaced_deployment(
        namespace, label_selector=f"{OWNER_LABEL}={owner_name}"
    )
    out: dict[str, dict] = {}
    for item in listing.items:
        d = api.sanitize_for_serialization(item)
        refs = d["metadata"].get("ownerReferences") or ()
        if not any(r.get("uid") == owner_uid for r in refs):
            continue
        component = d["metadata"].get("labels", {}).get("app.kubernetes.io/component")
        if component:
            out[component] = d
    return out


def owner_pods(namespace: str, owner_name: str) -> dict[str, list[dict]]:
    """The owner's pods by component, as plain dicts (for status: crash loops)."""
    api = api_client()
    listing = client.CoreV1Api(api).list_namespaced_pod(
        namespace, label_selector=f"{OWNER_LABEL}={owner_name}")
    out: dict[str, list[dict]] = {}
    for item in listing.items:
        pod = api.sanitize_for_serialization(item)
        component = pod["metadata"].get("labels", {}).get("app.kubernetes.io/component")
        if component:
            out.setdefault(component, []).append(pod)
    return out


def patch_status(namespace: str, name: str, status: Mapping[str, Any]) -> None:
    try:
        client.CustomObjectsApi(api_client()).patch_namespaced_custom_object_status(
            s.GROUP, s.VERSION, namespace, s.PLURAL, name, {"status": dict(status)},
            _content_type=MERGE,
        )
    except ApiException as exc:
        if exc.status != 404:  # deleted meanwhile: nothing left to report on
            raise


# ---- autoscaling (pods of a pool, deletion cost, events) ----------------------------------
def pool_pods(namespace: str, owner_name: str, component: str, port: int) -> list[dict]:
    """Live pods of one pool (the pool's selector labels) that have an IP:
    [{"name", "endpoint", "ready", "annotations"}]."""
    selector = (f"app.kubernetes.io/name=kvmesh,app.kubernetes.io/instance={owner_name},"
                f"app.kubernetes.io/component={component}")
    pods = client.CoreV1Api(api_client()).list_namespaced_pod(namespace, label_selector=selector)
    out = []
    for pod in pods.items:
        if not pod.status.pod_ip or pod.metadata.deletion_timestamp:
            continue
        ready = any(c.type == "Ready" and c.status == "True"
                    for c in (pod.status.conditions or ()))
        out.append({"name": pod.metadata.name, "endpoint": f"{pod.status.pod_ip}:{port}",
                    "ready": ready, "annotations": dict(pod.metadata.annotations or {})})
    return out


def ready_pool_pods(namespace: str, owner_name: str, component: str, port: int) -> list[dict]:
    """Ready pods of one pool: [{"name", "endpoint", ...}]."""
    return [p for p in pool_pods(namespace, owner_name, component, port) if p["ready"]]


def annotate_pod(namespace: str, pod: str, annotations: Mapping[str, str | None]) -> None:
    """Merge-patch a pod's annotations (a None value removes that annotation)."""
    client.CoreV1Api(api_client()).patch_namespaced_pod(
        pod, namespace, {"metadata": {"annotations": dict(annotations)}}, _content_type=MERGE)


def emit_event(obj: Mapping[str, Any], reason: str, message: str, type_: str = "Normal") -> None:
    """A core/v1 Event on the InferenceDeployment (what `kubectl describe infd` shows)."""
    meta = obj["metadata"]
    now = datetime.now(timezone.utc)
    body = client.CoreV1Event(
        metadata=client.V1ObjectMeta(generate_name=f"{meta['name']}.", namespace=meta["namespace"]),
        involved_object=client.V1ObjectReference(
            api_version=f"{s.GROUP}/{s.VERSION}", kind=s.KIND, name=meta["name"],
            namespace=meta["namespace"], uid=meta.get("uid")),
        reason=reason, message=message[:1024], type=type_, count=1,
        first_timestamp=now, last_timestamp=now,
        source=client.V1EventSource(component=FIELD_MANAGER))
    client.CoreV1Api(api_client()).create_namespaced_event(meta["namespace"], body)
