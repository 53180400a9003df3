"""The CRD's schema: structural, defaults identical to parse_spec's, CEL rules
referring to real fields, and the committed copies up to date. (The API
server's own verdict on the rules is in tests/e2e/test_crd_validation.py.)"""

import copy
import re
from pathlib import Path

import pytest

from kvmesh.operator import generate
from kvmesh.operator.crd import build_crd
from kvmesh.operator.spec import COMPONENTS, parse_spec

from tests.support.crs import MINIMAL_SPEC

ROOT = Path(__file__).resolve().parents[2]


def schema():
    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def walk(node, path="$"):
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from walk(sub, f"{path}.{name}")
    if "items" in node:
        yield from walk(node["items"], f"{path}[]")


def apply_defaults(node, value):
    """What the API server's defaulting does for objects and scalars."""
    if value is None:
        if "default" not in node:
            return None
        value = copy.deepcopy(node["default"])
    if node.get("type") == "object" and isinstance(value, dict):
        for name, sub in node.get("properties", {}).items():
            v = apply_defaults(sub, value.get(name))
            if v is not None:
                value[name] = v
    return value


def test_committed_generated_files_are_current():
    assert generate.stale_files(ROOT) == [], "run: python -m kvmesh.operator.generate"


def test_schema_is_structural():
    for path, node in walk(schema()):
        if path in ("$.metadata",):
            continue
        assert "type" in node or node.get("x-kubernetes-int-or-string"), path
        if "additionalProperties" in node:
            assert "properties" not in node, path
        if path.startswith("$.spec."):  # every user-facing field is documented
            assert node.get("description"), path


@pytest.mark.parametrize("spec", [
    MINIMAL_SPEC,
    {"model": {"name": "m"}},
    {"model": {"name": "m", "source": {"type": "URI", "uri": "https://x/m.gguf"}},
     "prefill": {"replicas": 0}, "decode": {"resources": {"cpu": "2"}}},
    {"model": {"name": "m", "dtype": "float32"}},
])
def test_crd_defaults_match_parse_spec_defaults(spec):
    defaulted = apply_defaults(schema()["properties"]["spec"], copy.deepcopy(spec))
    assert parse_spec(defaulted) == parse_spec(spec)
    for c in COMPONENTS:
        assert "replicas" in defaulted[c]  # every pool is present after defaulting


def test_cel_rules_only_reference_declared_fields():
    for path, node in walk(schema()):
        declared = set(node.get("properties", {}))
        for rule in node.get("x-kubernetes-validations", []):
            assert rule["message"] and not rule["message"].endswith(".")
            for field in re.findall(r"self\.([A-Za-z]+)", rule["rule"]):
                assert field in declared, f"{path}: {rule['rule']} uses unknown {field}"


def test_status_subresource_and_printer_columns():
    version = build_crd()["spec"]["versions"][0]
    assert version["subresources"]["status"] == {}
    names = [c["name"] for c in version["additionalPrinterColumns"]]
    assert names == ["Model", "Prefill", "Decode", "Cache", "Router", "Ready", "Age"]


def _schema_at(root: dict, path: str) -> dict:
    node = root
    for part in path.lstrip(".").split("."):
        node = node["properties"][part]
    return node


def test_scale_subresource_maps_to_declared_decode_fields():
    version = build_crd()["spec"]["versions"][0]
    scale = version["subresources"]["scale"]
    root = version["schema"]["openAPIV3Schema"]
    assert scale["specReplicasPath"] == ".spec.decode.replicas"
    assert _schema_at(root, scale["specReplicasPath"])["type"] == "integer"
    assert _schema_at(root, scale["statusReplicasPath"])["type"] == "integer"
    assert _schema_at(root, scale["labelSelectorPath"])["type"] == "string"


def test_scale_selector_in_status_selects_the_decode_pods():
    from kvmesh.operator.render import render_all
    from kvmesh.operator.status import compute_status

    cr = {"apiVersion": "serving.kvmesh.io/v1alpha1", "kind": "InferenceDeployment",
          "metadata": {"name": "llm", "namespace": "ns", "uid": "u", "generation": 1},
          "spec": copy.deepcopy(MINIMAL_SPEC)}
    selector = compute_status(cr, {}, "2026-01-01T00:00:00Z")["scaleSelector"]
    terms = dict(term.split("=") for term in selector.split(","))
    decode = next(o for o in render_all(cr) if o["kind"] == "Deployment"
                  and o["metadata"]["name"] == "llm-decode")
    assert terms == decode["spec"]["selector"]["matchLabels"]


def test_model_dtype_is_one_of_what_the_engine_accepts():
    from kvmesh.engine.config import EngineConfig

    dtype = schema()["properties"]["spec"]["properties"]["model"]["properties"]["dtype"]
    assert dtype["default"] == "auto" == EngineConfig().dtype
    for name in dtype["enum"]:
        EngineConfig(dtype=name).validate()  # raises for a name `kvmesh serve --dtype` would refuse
