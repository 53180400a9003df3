"""Fuzzed InferenceDeployment specs against the real parser and renderer: every spec is either
refused with a ``SpecError`` naming a field, or renders the full, serializable child set. Pure."""

from __future__ import annotations

import copy
import json

from hypothesis import HealthCheck, example, given, settings, strategies as st

from kvmesh.operator import render as r
from kvmesh.operator.spec import SpecError

from tests.support.crs import MINIMAL_SPEC, make_cr

# JSON values as a client's YAML could carry them (what the apiserver's schema would let through
# is narrower; the operator must not depend on it: CRD validation can be off or older).
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63) | st.floats(allow_nan=False)
    | st.text(max_size=12) | st.sampled_from(["", "0", "-1", "1Gi", "8GiB", "auto", "bfloat16", "x" * 300,
                                              "TTFTFirst", "TPOTGated"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8)

# Every field the spec reader looks at, by path (spec.py, crds/).
FIELDS = [
    ("model",), ("model", "name"), ("model", "dtype"), ("model", "format"), ("model", "source"),
    ("model", "source", "type"), ("model", "source", "uri"), ("model", "source", "volume"),
    ("model", "source", "volume", "persistentVolumeClaim"), ("model", "source", "volume", "hostPath"),
    ("model", "source", "volume", "persistentVolumeClaim", "claimName"), ("model", "source", "volume", "path"),
    ("model", "source", "volume", "hostPath", "path"), ("image",), ("imagePullPolicy",), ("slo",),
    ("slo", "ttftMs"), ("slo", "tpotMs"), ("slo", "percentile"), ("slo", "admission"), ("autoscaling",),
    ("autoscaling", "enabled"),
    ("autoscaling", "kvOccupancyTarget"), ("autoscaling", "scaleUpStabilizationSeconds"),
    ("autoscaling", "scaleDownStabilizationSeconds"), ("autoscaling", "metricsWindowSeconds"),
    ("router", "policy"), ("cache", "memory"), ("auth",), ("auth", "apiKeysSecret"), ("auth", "apiKeysKey"),
    ("auth", "isolateTenants"),
] + [(c, f) for c in ("prefill", "decode", "cache", "router")
     for f in ("replicas", "resources", "nodeSelector", "tolerations", "terminationGracePeriodSeconds",
               "minReplicas", "maxReplicas")] + [
    (c, "resources", f) for c in ("prefill", "decode", "cache", "router") for f in ("gpus", "cpu", "memory")
] + [(c,) for c in ("prefill", "decode", "cache", "router")] + [("decode", "tolerations", "0")]


def _set(spec: dict, path: tuple[str, ...], value: object) -> None:
    node = spec
    for key in path[:-1]:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[path[-1]] = value


@st.composite
def specs(draw) -> object:
    if draw(st.integers(0, 9)) == 0:
        return draw(JSON)  # not even an object, sometimes
    spec = copy.deepcopy(MINIMAL_SPEC)
    for path, value in draw(st.lists(st.tuples(st.sampled_from(FIELDS), JSON), min_size=1, max_size=4)):
        _set(spec, path, value)
    return spec


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs())
# What the fuzzer found first (each was a TypeError or AttributeError out of the operator):
@example(dict(MINIMAL_SPEC, slo={"percentile": None}))
@example(dict(MINIMAL_SPEC, prefill={"replicas": "two"}))
@example(dict(MINIMAL_SPEC, cache={"memory": ["1Gi"]}))
@example(dict(MINIMAL_SPEC, decode={"tolerations": {"key": "x"}}))
def test_a_spec_renders_or_is_refused_naming_a_field(spec):
    try:
        objs = r.render_all(make_cr(spec))
    except SpecError as e:
        assert str(e).startswith("spec"), str(e)  # names the field: "spec.decode.replicas: ..."
        return
    assert sorted(o["kind"] for o in objs) == sorted(
        ["ConfigMap", "NetworkPolicy"] + ["Deployment", "Service"] * len(r.s.COMPONENTS))
    json.dumps(objs)  # what is applied is plain JSON
    for o in objs:
        if o["kind"] == "Deployment":
            assert isinstance(o["spec"]["replicas"], int) and o["spec"]["replicas"] >= 0
