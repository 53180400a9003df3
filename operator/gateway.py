"""Gateway API Inference Extension objects for ``spec.router.mode: gateway`` (pure functions).

In gateway mode a GIE gateway (Envoy Gateway, kgateway, Istio, a static Envoy) is the entry
point: it asks an endpoint picker over Envoy's ext_proc which engine pod takes each request and
sends the request there itself. The operator renders

    <name>-pool    InferencePool (inference.networking.k8s.io/v1): the serving pods, their HTTP
                   port, and an endpointPickerRef to the router Service's ext_proc port
    <name>-route   HTTPRoute (gateway.networking.k8s.io/v1), only when spec.router.gateway.parentRef
                   names a Gateway: every path of that Gateway goes to the pool

The endpoint picker is the deployment's own router (``kvmesh router --ext-proc-port``): the same
Deployment and Service as in proxy mode, one more port, the same filters, scorers and pick. The
deployment's NetworkPolicy (render.render_network_policy) then opens the engines' HTTP port to
any source, since the gateway's Envoy runs wherever its installation put it.

Invariant: the objects of this module exist exactly while the spec asks for them; ``stale_refs``
names the ones a pass must delete (mode switched back to proxy, parentRef removed), since unlike
the ten fixed children they are not always rendered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import spec as s
from .owner import Owner, child_name, meta, selector_labels

POOL_GROUP = "inference.networking.k8s.io"
POOL_VERSION = "v1"
POOL_KIND = "InferencePool"
ROUTE_GROUP = "gateway.networking.k8s.io"
ROUTE_VERSION = "v1"
ROUTE_KIND = "HTTPRoute"
# (group, version, plural) of each kind, for the API calls (kube.py).
RESOURCES = {POOL_KIND: (POOL_GROUP, POOL_VERSION, "inferencepools"),
             ROUTE_KIND: (ROUTE_GROUP, ROUTE_VERSION, "httproutes")}
# The port GIE's gateways assume for an endpoint picker; the router serves ext_proc there.
EXT_PROC_PORT = 9002
EXT_PROC_PORT_NAME = "grpc-ext-proc"


@dataclass(frozen=True)
class ObjectRef:
    """A namespaced object by kind and name (what a pass may have to delete)."""

    kind: str
    namespace: str
    name: str


def pool_name(owner: Owner) -> str:
    return child_name(owner, "pool")


def route_name(owner: Owner) -> str:
    return child_name(owner, "route")


def serving_component(spec: s.InferenceSpec) -> str:
    """The pool the gateway sends requests to: gateway mode runs colocated engines (spec.py
    refuses prefill/decode disaggregation there), so the decode pool serves both phases."""
    return "decode"


def render_inference_pool(spec: s.InferenceSpec, owner: Owner, engine_port: int) -> dict[str, Any]:
    """The InferencePool selecting the serving pods (by the same immutable labels their Deployment
    selects on) with the router as its endpoint picker."""
    return {
        "apiVersion": f"{POOL_GROUP}/{POOL_VERSION}",
        "kind": POOL_KIND,
        "metadata": meta(owner, pool_name(owner), None),
        "spec": {
            "selector": {"matchLabels": selector_labels(owner, serving_component(spec))},
            "targetPorts": [{"number": engine_port}],
            "endpointPickerRef": {
                "group": "",
                "kind": "Service",
                "name": child_name(owner, "router"),
                # A Service's port number (not the target port), as GIE asks.
                "port": {"number": EXT_PROC_PORT},
                "failureMode": spec.gateway.failure_mode,
            },
        },
    }


def render_http_route(spec: s.InferenceSpec, owner: Owner) -> dict[str, Any] | None:
    """The HTTPRoute from the named Gateway to the pool (None without a parentRef)."""
    parent = spec.gateway.parent_ref
    if parent is None:
        return None
    ref: dict[str, Any] = {"group": ROUTE_GROUP, "kind": "Gateway", "name": parent.name}
    if parent.namespace:
        ref["namespace"] = parent.namespace
    if parent.section_name:
        ref["sectionName"] = parent.section_name
    return {
        "apiVersion": f"{ROUTE_GROUP}/{ROUTE_VERSION}",
        "kind": ROUTE_KIND,
        "metadata": meta(owner, route_name(owner), None),
        "spec": {
            "parentRefs": [ref],
            "rules": [{
                "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                "backendRefs": [{"group": POOL_GROUP, "kind": POOL_KIND, "name": pool_name(owner)}],
            }],
        },
    }


def render_gateway_objects(spec: s.InferenceSpec, owner: Owner, engine_port: int) -> list[dict[str, Any]]:
    """The GIE objects the spec asks for (none in proxy mode)."""
    if not spec.gateway.enabled:
        return []
    route = render_http_route(spec, owner)
    return [render_inference_pool(spec, owner, engine_port)] + ([route] if route else [])


def stale_refs(spec: s.InferenceSpec, owner: Owner) -> list[ObjectRef]:
    """The GIE objects that must not exist for this spec (deleting an absent one is a no-op)."""
    out = []
    if not spec.gateway.enabled:
        out.append(ObjectRef(POOL_KIND, owner.namespace, pool_name(owner)))
    if not spec.gateway.enabled or spec.gateway.parent_ref is None:
        out.append(ObjectRef(ROUTE_KIND, owner.namespace, route_name(owner)))
    return out
