"""The API server itself enforces the CRD: CEL messages, strict fields, defaults."""

from __future__ import annotations

import copy
import json

import pytest
from kubernetes.client.rest import ApiException

from tests.support.crs import MINIMAL_SPEC

from .helpers import Cluster

pytestmark = pytest.mark.e2e

VALID = copy.deepcopy(MINIMAL_SPEC)


def rejected(cluster: Cluster, ns: str, name: str, spec: dict, status: int = 422) -> str:
    with pytest.raises(ApiException) as info:
        cluster.create_cr(ns, name, spec)
    assert info.value.status == status, info.value.body
    return json.loads(info.value.body)["message"]


def edited(**changes) -> dict:
    spec = copy.deepcopy(VALID)
    for path, value in changes.items():
        *parents, leaf = path.split("__")
        node = spec
        for p in parents:
            node = node.setdefault(p, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return spec


def test_minimal_valid_spec_is_accepted_and_defaulted(cluster, crd_installed, namespace):
    obj = cluster.create_cr(namespace, "minimal", VALID)
    spec = obj["spec"]
    assert spec["image"] == "kvmesh/kvmesh:0.1.0"
    assert spec["router"]["policy"] == "cache-aware"
    assert spec["decode"]["resources"]["gpus"] == 1
    assert spec["cache"]["memory"] == "8Gi"
    assert spec["slo"]["percentile"] == 95
    assert spec["slo"]["admission"] == "FirstCome"
    assert spec["model"]["source"]["type"] == "Embedded"
    assert spec["autoscaling"]["enabled"] is False
    assert spec["model"]["dtype"] == "auto"
    assert spec["model"]["stateCheckpoints"] == {"intervalTokens": 1024}


@pytest.mark.parametrize("name,spec,message", [
    ("min-gt-max", edited(decode__minReplicas=3, decode__maxReplicas=1),
     "minReplicas must be less than or equal to maxReplicas"),
    ("above-max", edited(decode__maxReplicas=1),
     "replicas must be less than or equal to maxReplicas"),
    ("below-min", edited(router__minReplicas=2),
     "replicas must be greater than or equal to minReplicas"),
    ("zero-ttft", edited(slo__ttftMs=0), "slo.ttftMs must be positive"),
    ("negative-tpot", edited(slo__tpotMs=-5), "slo.tpotMs must be positive"),
    ("percentile", edited(slo__percentile=150), "slo.percentile must be in (0, 100]"),
    ("ttft-first-without-target", edited(slo={"admission": "TTFTFirst"}),
     "slo.admission TTFTFirst and TPOTGated need slo.ttftMs"),
    ("gated-without-tpot", edited(slo={"admission": "TPOTGated", "ttftMs": 1000}),
     "slo.admission TPOTGated needs slo.tpotMs"),
    ("bad-admission", edited(slo__admission="fifo"), "Unsupported value: \"fifo\""),
    ("negative-replicas", edited(cache__replicas=-1), "replicas must not be negative"),
    ("no-decode", edited(decode__replicas=0),
     "decode.replicas must be at least 1 while prefill.replicas > 0"),
    ("volume-without-volume", edited(model__source={"type": "Volume"}),
     "source.volume is required when source.type is Volume"),
    ("bad-policy", edited(router__policy="random"), "Unsupported value: \"random\""),
    ("bad-dtype", edited(model__dtype="fp8"), "Unsupported value: \"fp8\""),
    ("occupancy", edited(autoscaling={"kvOccupancyTarget": 1.5}),
     "autoscaling.kvOccupancyTarget must be in (0, 1]"),
    ("isolation-without-keys", edited(auth={"isolateTenants": True}),
     "auth.isolateTenants needs auth.apiKeysSecret"),
    ("gateway-in-proxy-mode", edited(router__gateway={"failureMode": "FailOpen"}),
     "router.gateway needs router.mode: gateway"),
    ("gateway-disaggregated", edited(router__mode="gateway"), "router.mode gateway serves colocated engines"),
    ("gateway-isolated", edited(prefill__replicas=0, router__mode="gateway",
                                auth={"apiKeysSecret": "k", "isolateTenants": True}),
     "auth.isolateTenants needs router.mode proxy"),
    ("gateway-parent-without-name", edited(prefill__replicas=0, router__mode="gateway",
                                           router__gateway={"parentRef": {"namespace": "gw"}}),
     "Required value"),
    ("bad-router-mode", edited(router__mode="ingress"), "Unsupported value: \"ingress\""),
    ("checkpoint-interval", edited(model__stateCheckpoints={"intervalTokens": 100}),
     "stateCheckpoints.intervalTokens must be 0 or a multiple of 16"),
])
def test_invalid_specs_are_rejected_with_their_message(cluster, crd_installed, namespace, name,
                                                       spec, message):
    assert message in rejected(cluster, namespace, name, spec)


def test_missing_model_name_is_rejected(cluster, crd_installed, namespace):
    message = rejected(cluster, namespace, "no-name", edited(model__name=None))
    assert "spec.model.name: Required value" in message


def test_unknown_field_is_rejected(cluster, crd_installed, namespace):
    # Strict field validation (kubectl's default) refuses to decode the object.
    message = rejected(cluster, namespace, "unknown", edited(decode__replicaz=3), status=400)
    assert 'unknown field "spec.decode.replicaz"' in message


def test_name_that_cannot_name_a_service_is_rejected(cluster, crd_installed, namespace):
    message = rejected(cluster, namespace, "9lives", VALID)
    assert "metadata.name must start with a letter" in message


def test_printer_columns(cluster, crd_installed, namespace):
    cluster.create_cr(namespace, "columns", VALID)
    out = cluster.kubectl("get", "infd", "columns", "-n", namespace).stdout
    header = out.splitlines()[0].split()
    assert header == ["NAME", "MODEL", "PREFILL", "DECODE", "CACHE", "ROUTER", "READY", "AGE"]
    assert "smollm2-135m-instruct" in out.splitlines()[1]
