"""spec.router.mode gateway: the InferencePool, the HTTPRoute, the router as endpoint picker, and
their removal when the spec stops asking for them. Pure rendering and the reconcile pass against
in-memory fakes; the real apiserver validating these objects against the upstream CRDs is
tests/e2e/test_gateway_objects.py."""

import copy

import pytest

from kvmesh.operator import gateway as gw
from kvmesh.operator import render as r
from kvmesh.operator import spec as s
from kvmesh.operator.reconcile import KubeOps, Reconciler
from kvmesh.operator.status import compute_status

from tests.support.crs import MINIMAL_SPEC, make_cr

GATEWAY = {**copy.deepcopy(MINIMAL_SPEC), "prefill": {"replicas": 0},
           "router": {"replicas": 1, "mode": "gateway"}}


def gateway_spec(**router_gateway):
    spec = copy.deepcopy(GATEWAY)
    if router_gateway:
        spec["router"]["gateway"] = router_gateway
    return spec


def by_key(objs):
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def test_proxy_mode_renders_no_gateway_objects_and_no_picker_port():
    objs = by_key(r.render_all(make_cr()))
    assert not [k for k in objs if k[0] in (gw.POOL_KIND, gw.ROUTE_KIND)]
    router = objs[("Deployment", "llm-router")]["spec"]["template"]["spec"]["containers"][0]
    assert "--ext-proc-port" not in router["args"]
    assert [p["name"] for p in objs[("Service", "llm-router")]["spec"]["ports"]] == ["http"]


def test_gateway_mode_pool_selects_the_serving_pods_and_names_the_router_as_picker():
    objs = by_key(r.render_all(make_cr(gateway_spec())))
    pool = objs[(gw.POOL_KIND, "llm-pool")]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    decode = objs[("Deployment", "llm-decode")]
    # The pool selects exactly the pods the serving Deployment owns (its immutable selector).
    assert pool["spec"]["selector"]["matchLabels"] == decode["spec"]["selector"]["matchLabels"]
    engine_port = decode["spec"]["template"]["spec"]["containers"][0]["ports"][0]
    assert pool["spec"]["targetPorts"] == [{"number": engine_port["containerPort"]}]
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["kind"] == "Service" and ref["failureMode"] == "FailClose"
    # The picker's Service exists, serves that port, and its pods listen on it.
    service = objs[("Service", ref["name"])]
    port = next(p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"])
    router = objs[("Deployment", ref["name"])]["spec"]["template"]["spec"]["containers"][0]
    assert any(p["name"] == port["targetPort"] for p in router["ports"])
    assert router["args"][router["args"].index("--ext-proc-port") + 1] == str(gw.EXT_PROC_PORT)
    # Owned by the CR like every child: the garbage collector removes it with the CR.
    assert pool["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert (gw.ROUTE_KIND, "llm-route") not in objs  # no parentRef: no HTTPRoute


def test_gateway_mode_opens_the_engines_http_port_and_nothing_else():
    proxy = by_key(r.render_all(make_cr()))[("NetworkPolicy", "llm-internal")]["spec"]["ingress"]
    gated = by_key(r.render_all(make_cr(gateway_spec())))[("NetworkPolicy", "llm-internal")]["spec"]["ingress"]
    assert gated[:-1] == proxy
    assert gated[-1] == {"ports": [{"port": r.ENGINE_PORT, "protocol": "TCP"}]}


def test_a_parent_ref_renders_an_http_route_to_the_pool():
    objs = by_key(r.render_all(make_cr(gateway_spec(
        parentRef={"name": "inference-gateway", "namespace": "gateways", "sectionName": "http"},
        failureMode="FailOpen"))))
    route = objs[(gw.ROUTE_KIND, "llm-route")]
    assert route["spec"]["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway",
                                            "name": "inference-gateway", "namespace": "gateways",
                                            "sectionName": "http"}]
    assert route["spec"]["rules"][0]["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "llm-pool"}]
    assert objs[(gw.POOL_KIND, "llm-pool")]["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"


def test_client_keys_are_checked_where_clients_arrive():
    """Behind a gateway, requests reach the serving engines directly: the keys go there too."""
    spec = gateway_spec()
    spec["auth"] = {"apiKeysSecret": "llm-keys"}
    objs = by_key(r.render_all(make_cr(spec)))
    for component in ("decode", "router"):
        pod = objs[("Deployment", f"llm-{component}")]["spec"]["template"]["spec"]
        assert "--api-key-file" in pod["containers"][0]["args"], component
        assert any(v.get("secret", {}).get("secretName") == "llm-keys" for v in pod["volumes"]), component
    proxy = copy.deepcopy(MINIMAL_SPEC)
    proxy["auth"] = {"apiKeysSecret": "llm-keys"}
    decode = by_key(r.render_all(make_cr(proxy)))[("Deployment", "llm-decode")]["spec"]["template"]["spec"]
    assert "--api-key-file" not in decode["containers"][0]["args"]


@pytest.mark.parametrize("change,message", [
    ({"prefill": {"replicas": 1}}, "colocated"),
    ({"router": {"mode": "proxy", "gateway": {"failureMode": "FailOpen"}}}, "mode: gateway"),
    ({"router": {"mode": "gateway", "gateway": {"failureMode": "Sometimes"}}}, "failureMode"),
    ({"router": {"mode": "gateway", "gateway": {"parentRef": {"namespace": "x"}}}}, "parentRef.name"),
    ({"router": {"mode": "ingress"}}, "spec.router.mode"),
    ({"auth": {"apiKeysSecret": "k", "isolateTenants": True}}, "isolateTenants"),
])
def test_specs_gateway_mode_cannot_serve_are_refused_with_the_field(change, message):
    with pytest.raises(s.SpecError, match=message):
        s.parse_spec({**GATEWAY, **change})


class FakeApi:
    def __init__(self, obj):
        self.obj, self.applied, self.deleted = obj, [], []

    def ops(self):
        return KubeOps(get=lambda ns, name: self.obj, apply=self.applied.append,
                       deployments=lambda ns, name, uid: {}, patch_status=lambda ns, name, st: None,
                       create_if_absent=lambda m: None, apply_error=ValueError,
                       delete_owned=lambda ref, uid: self.deleted.append((ref, uid)))


def test_a_pass_deletes_the_gateway_objects_the_spec_no_longer_asks_for():
    api = FakeApi(make_cr(gateway_spec(parentRef={"name": "gw"})))
    Reconciler(api.ops()).reconcile("serving", "llm")
    assert {m["kind"] for m in api.applied} >= {gw.POOL_KIND, gw.ROUTE_KIND} and api.deleted == []
    api.obj = make_cr(gateway_spec())  # parentRef removed: the route goes, the pool stays
    api.applied.clear()
    Reconciler(api.ops()).reconcile("serving", "llm")
    assert api.deleted == [(gw.ObjectRef(gw.ROUTE_KIND, "serving", "llm-route"), "uid-1")]
    api.obj, api.deleted = make_cr(), []  # back to proxy mode: both go
    Reconciler(api.ops()).reconcile("serving", "llm")
    assert [ref.kind for ref, _ in api.deleted] == [gw.POOL_KIND, gw.ROUTE_KIND]


def test_status_names_the_pool_only_once_it_is_applied():
    obj = make_cr(gateway_spec())
    assert compute_status(obj, {}, "2026-01-01T00:00:00Z")["inferencePool"] == "llm-pool"
    failed = compute_status(obj, {}, "2026-01-01T00:00:00Z", error="InferencePool llm-pool: not served")
    assert failed["inferencePool"] is None
    assert compute_status(make_cr(), {}, "2026-01-01T00:00:00Z")["inferencePool"] is None
