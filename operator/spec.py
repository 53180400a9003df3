"""The InferenceDeployment spec as typed, defaulted dataclasses.

`parse_spec` is the only way the operator reads a spec: it applies the same
defaults the CRD schema declares (crd.py builds the schema from the constants
here, so the two cannot drift), so rendering works the same on an object the
API server defaulted and on a plain dict in a unit test. It does not repeat the
CRD's validation; it raises `SpecError` only for what would make rendering
impossible (a missing model name, a malformed quantity).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from .quantity import QuantityError, parse_quantity

GROUP = "serving.kvmesh.io"
VERSION = "v1alpha1"
KIND = "InferenceDeployment"
PLURAL = "inferencedeployments"
SINGULAR = "inferencedeployment"
SHORT_NAMES = ("infd",)

COMPONENTS = ("prefill", "decode", "cache", "router")
ROUTER_POLICIES = ("cache-aware", "session", "least-load", "round-robin")
# The policies that route by cached prefix, so need the engines' tokenizer (the router's
# `policies.uses_prefix`; tests/util/test_rendered_command_lines.py checks they agree).
PREFIX_ROUTER_POLICIES = ("cache-aware", "session")
SOURCE_TYPES = ("Embedded", "Volume", "URI")
MODEL_FORMATS = ("Auto", "GGUF", "Safetensors")
# Weights and KV dtype of the engines (`kvmesh serve --dtype`); `auto`, the engine's own default,
# picks what each engine's node computes natively (engine/dtype_choice.py).
DTYPES = ("auto", "bfloat16", "float16", "float32")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")

DEFAULT_IMAGE = "kvmesh/kvmesh:0.1.0"
DEFAULT_PULL_POLICY = "IfNotPresent"
DEFAULT_DTYPE = "auto"
DEFAULT_REPLICAS = 1
DEFAULT_GPUS = 1
DEFAULT_CACHE_MEMORY = "8Gi"
DEFAULT_ROUTER_POLICY = "cache-aware"
DEFAULT_PERCENTILE = 95.0
DEFAULT_KV_OCCUPANCY_TARGET = 0.8
DEFAULT_SCALE_UP_WINDOW_S = 30
DEFAULT_SCALE_DOWN_WINDOW_S = 300
DEFAULT_METRICS_WINDOW_S = 60
# Long enough for an engine to finish the requests it has admitted after the
# router stops sending it new ones (SIGTERM starts the drain).
DEFAULT_GRACE_S = {"prefill": 120, "decode": 300, "cache": 30, "router": 60}


class SpecError(ValueError):
    """A spec the operator cannot render; the message names the field."""


@dataclass(frozen=True)
class Toleration:
    key: str | None = None
    operator: str | None = None
    value: str | None = None
    effect: str | None = None
    toleration_seconds: int | None = None

    def to_manifest(self) -> dict[str, Any]:
        out = {
            "key": self.key,
            "operator": self.operator,
            "value": self.value,
            "effect": self.effect,
            "tolerationSeconds": self.toleration_seconds,
        }
        return {k: v for k, v in out.items() if v is not None}


@dataclass(frozen=True)
class Resources:
    """Per-pod resources. `gpus` is only meaningful for prefill and decode."""

    gpus: int = 0
    cpu: str | None = None
    memory: str | None = None


@dataclass(frozen=True)
class Component:
    """One pool. Invariant (enforced by the CRD): min <= replicas <= max where set."""

    name: str
    replicas: int = DEFAULT_REPLICAS
    min_replicas: int | None = None
    max_replicas: int | None = None
    resources: Resources = field(default_factory=Resources)
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Toleration, ...] = ()
    termination_grace_period_seconds: int = 60
    # cache only
    memory: str | None = None
    # router only
    policy: str | None = None


@dataclass(frozen=True)
class VolumeSource:
    claim_name: str | None = None
    host_path: str | None = None
    path: str = ""


@dataclass(frozen=True)
class Model:
    name: str
    source_type: str = "Embedded"
    uri: str | None = None
    volume: VolumeSource | None = None
    format: str = "Auto"
    dtype: str = DEFAULT_DTYPE


@dataclass(frozen=True)
class Slo:
    ttft_ms: int | None = None
    tpot_ms: int | None = None
    percentile: float = DEFAULT_PERCENTILE


@dataclass(frozen=True)
class Autoscaling:
    enabled: bool = False
    kv_occupancy_target: float = DEFAULT_KV_OCCUPANCY_TARGET
    scale_up_stabilization_seconds: int = DEFAULT_SCALE_UP_WINDOW_S
    scale_down_stabilization_seconds: int = DEFAULT_SCALE_DOWN_WINDOW_S
    metrics_window_seconds: int = DEFAULT_METRICS_WINDOW_S


@dataclass(frozen=True)
class InferenceSpec:
    model: Model
    image: str
    image_pull_policy: str
    prefill: Component
    decode: Component
    cache: Component
    router: Component
    slo: Slo
    autoscaling: Autoscaling

    @property
    def colocated(self) -> bool:
        """prefill.replicas == 0: the decode pool runs both phases."""
        return self.prefill.replicas == 0

    def component(self, name: str) -> Component:
        return getattr(self, name)


def _obj(raw: Any, where: str) -> Mapping[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise SpecError(f"{where} must be an object, got {type(raw).__name__}")
    return raw


def _quantity(raw: Any, where: str) -> str | None:
    if raw is None:
        return None
    try:
        parse_quantity(raw)
    except QuantityError as exc:
        raise SpecError(f"{where}: {exc}") from None
    return str(raw)


def _tolerations(raw: Any, where: str) -> tuple[Toleration, ...]:
    out = []
    for i, item in enumerate(raw or ()):
        t = _obj(item, f"{where}[{i}]")
        out.append(
            Toleration(
                key=t.get("key"),
                operator=t.get("operator"),
                value=t.get("value"),
                effect=t.get("effect"),
                toleration_seconds=t.get("tolerationSeconds"),
            )
        )
    return tuple(out)


def _component(name: str, raw: Any) -> Component:
    where = f"spec.{name}"
    c = _obj(raw, where)
    r = _obj(c.get("resources"), f"{where}.resources")
    gpu_pool = name in ("prefill", "decode")
    return Component(
        name=name,
        replicas=int(c.get("replicas", DEFAULT_REPLICAS)),
        min_replicas=c.get("minReplicas"),
        max_replicas=c.get("maxReplicas"),
        resources=Resources(
            gpus=int(r.get("gpus", DEFAULT_GPUS)) if gpu_pool else 0,
            cpu=_quantity(r.get("cpu"), f"{where}.resources.cpu"),
            memory=_quantity(r.get("memory"), f"{where}.resources.memory"),
        ),
        node_selector=dict(_obj(c.get("nodeSelector"), f"{where}.nodeSelector")),
        tolerations=_tolerations(c.get("tolerations"), f"{where}.tolerations"),
        termination_grace_period_seconds=int(
            c.get("terminationGracePeriodSeconds", DEFAULT_GRACE_S[name])
        ),
        memory=_quantity(c.get("memory", DEFAULT_CACHE_MEMORY), f"{where}.memory")
        if name == "cache"
        else None,
        policy=str(c.get("policy", DEFAULT_ROUTER_POLICY)) if name == "router" else None,
    )


def _model(raw: Any) -> Model:
    m = _obj(raw, "spec.model")
    name = m.get("name")
    if not name:
        raise SpecError("spec.model.name is required (e.g. smollm2-135m-instruct)")
    src = _obj(m.get("source"), "spec.model.source")
    volume = None
    if src.get("volume") is not None:
        v = _obj(src["volume"], "spec.model.source.volume")
        volume = VolumeSource(
            claim_name=_obj(v.get("persistentVolumeClaim"), "persistentVolumeClaim").get(
                "claimName"
            ),
            host_path=_obj(v.get("hostPath"), "hostPath").get("path"),
            path=str(v.get("path", "")).strip("/"),
        )
    source_type = str(src.get("type", "Embedded"))
    if source_type == "Volume" and (
        volume is None or (volume.claim_name is None) == (volume.host_path is None)
    ):
        raise SpecError(
            "spec.model.source.volume needs exactly one of persistentVolumeClaim or hostPath"
        )
    if source_type == "URI" and not src.get("uri"):
        raise SpecError("spec.model.source.uri is required when source.type is URI")
    dtype = str(m.get("dtype", DEFAULT_DTYPE))
    if dtype not in DTYPES:
        # The CRD's enum rejects it first; checked here too because the engine would exit at start.
        raise SpecError(f"spec.model.dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return Model(
        name=str(name),
        source_type=source_type,
        uri=src.get("uri"),
        volume=volume,
        format=str(m.get("format", "Auto")),
        dtype=dtype,
    )


def parse_spec(spec: Mapping[str, Any]) -> InferenceSpec:
    """Typed, defaulted view of `.spec` (raises SpecError naming the bad field)."""
    spec = _obj(spec, "spec")
    slo = _obj(spec.get("slo"), "spec.slo")
    auto = _obj(spec.get("autoscaling"), "spec.autoscaling")
    return InferenceSpec(
        model=_model(spec.get("model")),
        image=str(spec.get("image", DEFAULT_IMAGE)),
        image_pull_policy=str(spec.get("imagePullPolicy", DEFAULT_PULL_POLICY)),
        prefill=_component("prefill", spec.get("prefill")),
        decode=_component("decode", spec.get("decode")),
        cache=_component("cache", spec.get("cache")),
        router=_component("router", spec.get("router")),
        slo=Slo(
            ttft_ms=slo.get("ttftMs"),
            tpot_ms=slo.get("tpotMs"),
            percentile=float(slo.get("percentile", DEFAULT_PERCENTILE)),
        ),
        autoscaling=Autoscaling(
            enabled=bool(auto.get("enabled", False)),
            kv_occupancy_target=float(
                auto.get("kvOccupancyTarget", DEFAULT_KV_OCCUPANCY_TARGET)
            ),
            scale_up_stabilization_seconds=int(
                auto.get("scaleUpStabilizationSeconds", DEFAULT_SCALE_UP_WINDOW_S)
            ),
            scale_down_stabilization_seconds=int(
                auto.get("scaleDownStabilizationSeconds", DEFAULT_SCALE_DOWN_WINDOW_S)
            ),
            metrics_window_seconds=int(
                auto.get("metricsWindowSeconds", DEFAULT_METRICS_WINDOW_S)
            ),
        ),
    )
