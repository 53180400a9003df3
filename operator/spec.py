"""The InferenceDeployment spec as typed, defaulted dataclasses.

`parse_spec` is the only way the operator reads a spec: it applies the same
defaults the CRD schema declares (crd.py builds the schema from the constants
here, so the two cannot drift), so rendering works the same on an object the
API server defaulted and on a plain dict in a unit test. It does not repeat the
CRD's validation of ranges and enums; it raises `SpecError` for what would make rendering
impossible or the result invalid (a missing model name, a malformed quantity, a value of the
wrong type, a negative count), so a spec the apiserver did not validate (an old CRD, a plain
dict) is refused with a message naming the field, never a crash.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from kvmesh.engine.util import fleet_args as fa

from .quantity import QuantityError, parse_quantity

GROUP = "serving.kvmesh.io"
VERSION = "v1alpha1"
KIND = "InferenceDeployment"
PLURAL = "inferencedeployments"
SINGULAR = "inferencedeployment"
SHORT_NAMES = ("infd",)

COMPONENTS = ("prefill", "decode", "cache", "router")
ROUTER_POLICIES = ("cache-aware", "session", "least-load", "round-robin")
# proxy: the router Service is the entry point. gateway: a Gateway API Inference Extension gateway
# is, and the router serves it as the endpoint picker of an InferencePool (operator/gateway.py).
ROUTER_MODES = ("proxy", "gateway")
DEFAULT_ROUTER_MODE = "proxy"
# What the InferencePool's gateway does while the endpoint picker does not answer (GIE's enum).
FAILURE_MODES = ("FailClose", "FailOpen")
DEFAULT_FAILURE_MODE = "FailClose"
# The policies that route by cached prefix, so need the engines' tokenizer (the router's
# `policies.uses_prefix`; tests/util/test_rendered_command_lines.py checks they agree).
PREFIX_ROUTER_POLICIES = ("cache-aware", "session")
SOURCE_TYPES = ("Embedded", "Volume", "URI")
MODEL_FORMATS = ("Auto", "GGUF", "Safetensors")
# Weights and KV dtype of the engines (`kvmesh serve --dtype`); `auto`, the engine's own default,
# picks what each engine's node computes natively (engine/dtype_choice.py).
DTYPES = ("auto", "bfloat16", "float16", "float32")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
# How the engines admit waiting requests against spec.slo (docs/operator.md; the names and what each
# needs are engine/util/fleet_args.py's, shared with `kvmesh up --admission`).
ADMISSIONS = tuple(fa.ADMISSIONS)
DEFAULT_ADMISSION = "FirstCome"

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
DEFAULT_API_KEYS_KEY = "keys"
# Recurrent-state checkpoints of hybrid models (`kvmesh serve --state-checkpoint-interval/-bytes`;
# docs/engine.md "Hybrid models"): the engine's defaults, rendered explicitly. An interval is a
# multiple of the engines' block size (16, which the operator does not change); 0 turns the
# interval checkpoints off. Models without recurrent layers ignore both.
ENGINE_BLOCK_SIZE = 16
DEFAULT_STATE_CHECKPOINT_INTERVAL = 1024
DEFAULT_STATE_CHECKPOINT_MEMORY = "512Mi"
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
    state_checkpoint_interval: int = DEFAULT_STATE_CHECKPOINT_INTERVAL
    state_checkpoint_memory: str = DEFAULT_STATE_CHECKPOINT_MEMORY


@dataclass(frozen=True)
class Slo:
    ttft_ms: int | None = None
    tpot_ms: int | None = None
    percentile: float = DEFAULT_PERCENTILE
    admission: str = DEFAULT_ADMISSION


@dataclass(frozen=True)
class Autoscaling:
    enabled: bool = False
    kv_occupancy_target: float = DEFAULT_KV_OCCUPANCY_TARGET
    scale_up_stabilization_seconds: int = DEFAULT_SCALE_UP_WINDOW_S
    scale_down_stabilization_seconds: int = DEFAULT_SCALE_DOWN_WINDOW_S
    metrics_window_seconds: int = DEFAULT_METRICS_WINDOW_S


@dataclass(frozen=True)
class ClientAuth:
    """Who may call the router's OpenAI endpoints (the internal token is the operator's own)."""

    api_keys_secret: str | None = None
    """A Secret in the deployment's namespace holding the client keys, one per line."""
    api_keys_key: str = DEFAULT_API_KEYS_KEY
    """The Secret's key that holds them."""
    isolate_tenants: bool = False
    """A prefix cache per key (``kvmesh router --isolate-tenants``)."""


@dataclass(frozen=True)
class ParentRef:
    """The Gateway an HTTPRoute attaches to (Gateway API's ParentReference, Gateway kind only)."""

    name: str
    namespace: str | None = None
    section_name: str | None = None


@dataclass(frozen=True)
class Gateway:
    """``spec.router.mode`` and ``spec.router.gateway``. Invariant: ``parent_ref`` and a non-default
    ``failure_mode`` only in gateway mode (the CRD's CEL and ``parse_spec`` both refuse them in proxy
    mode, so a field that would do nothing is never silently accepted)."""

    mode: str = DEFAULT_ROUTER_MODE
    parent_ref: ParentRef | None = None
    failure_mode: str = DEFAULT_FAILURE_MODE

    @property
    def enabled(self) -> bool:
        return self.mode == "gateway"


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
    auth: ClientAuth = field(default_factory=ClientAuth)
    gateway: Gateway = field(default_factory=Gateway)

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


_INT32_MAX = 2**31 - 1


def _int(raw: Any, where: str, default: int | None, minimum: int = 0) -> int | None:
    """An integer field (None or absent: ``default``) in ``[minimum, 2**31 - 1]``."""
    if raw is None:
        return default
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw) or raw != int(raw):
        raise SpecError(f"{where} must be an integer, got {raw!r}")
    if not minimum <= raw <= _INT32_MAX:
        raise SpecError(f"{where} must be in [{minimum}, {_INT32_MAX}], got {int(raw)}")
    return int(raw)


def _number(raw: Any, where: str, default: float | None, low: float, high: float,
            keep_int: bool = False) -> float | None:
    """A number field (None or absent: ``default``) in ``(low, high]``; ``keep_int`` leaves an
    integer as it came (milliseconds print as written)."""
    if raw is None:
        return default
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw):
        raise SpecError(f"{where} must be a number, got {raw!r}")
    if not low < raw <= high:
        raise SpecError(f"{where} must be in ({low:g}, {high:g}], got {raw!r}")
    return raw if keep_int and isinstance(raw, int) else float(raw)


def _text(raw: Any, where: str, default: str | None) -> str | None:
    """A string field (None or absent: ``default``); numbers are taken as their text."""
    if raw is None:
        return default
    if isinstance(raw, bool) or not isinstance(raw, (str, int, float)):
        raise SpecError(f"{where} must be a string, got {type(raw).__name__}")
    return str(raw)


def _labels(raw: Any, where: str) -> dict[str, str]:
    out = {}
    for k, v in _obj(raw, where).items():
        text = _text(v, f"{where}.{k}", None)
        if text is None:
            raise SpecError(f"{where}.{k} must be a string, got null")
        out[str(k)] = text
    return out


def _flag(raw: Any, where: str) -> bool:
    if raw is None:
        return False
    if not isinstance(raw, bool):
        raise SpecError(f"{where} must be true or false, got {raw!r}")
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
    if raw is not None and not isinstance(raw, list):
        raise SpecError(f"{where} must be a list, got {type(raw).__name__}")
    out = []
    for i, item in enumerate(raw or ()):
        t = _obj(item, f"{where}[{i}]")
        at = f"{where}[{i}]"
        out.append(
            Toleration(
                key=_text(t.get("key"), f"{at}.key", None),
                operator=_text(t.get("operator"), f"{at}.operator", None),
                value=_text(t.get("value"), f"{at}.value", None),
                effect=_text(t.get("effect"), f"{at}.effect", None),
                toleration_seconds=_int(t.get("tolerationSeconds"), f"{at}.tolerationSeconds", None),
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
        replicas=_int(c.get("replicas"), f"{where}.replicas", DEFAULT_REPLICAS),
        min_replicas=_int(c.get("minReplicas"), f"{where}.minReplicas", None),
        max_replicas=_int(c.get("maxReplicas"), f"{where}.maxReplicas", None),
        resources=Resources(
            gpus=_int(r.get("gpus"), f"{where}.resources.gpus", DEFAULT_GPUS) if gpu_pool else 0,
            cpu=_quantity(r.get("cpu"), f"{where}.resources.cpu"),
            memory=_quantity(r.get("memory"), f"{where}.resources.memory"),
        ),
        node_selector=_labels(c.get("nodeSelector"), f"{where}.nodeSelector"),
        tolerations=_tolerations(c.get("tolerations"), f"{where}.tolerations"),
        termination_grace_period_seconds=_int(
            c.get("terminationGracePeriodSeconds"), f"{where}.terminationGracePeriodSeconds", DEFAULT_GRACE_S[name]
        ),
        memory=_quantity(_text(c.get("memory"), f"{where}.memory", None) or DEFAULT_CACHE_MEMORY, f"{where}.memory")
        if name == "cache"
        else None,
        policy=_text(c.get("policy"), f"{where}.policy", DEFAULT_ROUTER_POLICY) if name == "router" else None,
    )


def _model(raw: Any) -> Model:
    m = _obj(raw, "spec.model")
    name = _text(m.get("name"), "spec.model.name", None)
    if not name:
        raise SpecError("spec.model.name is required (e.g. smollm2-135m-instruct)")
    src = _obj(m.get("source"), "spec.model.source")
    volume = None
    if src.get("volume") is not None:
        v = _obj(src["volume"], "spec.model.source.volume")
        at = "spec.model.source.volume"
        volume = VolumeSource(
            claim_name=_text(_obj(v.get("persistentVolumeClaim"), f"{at}.persistentVolumeClaim").get("claimName"),
                             f"{at}.persistentVolumeClaim.claimName", None),
            host_path=_text(_obj(v.get("hostPath"), f"{at}.hostPath").get("path"), f"{at}.hostPath.path", None),
            path=(_text(v.get("path"), f"{at}.path", "") or "").strip("/"),
        )
    source_type = _text(src.get("type"), "spec.model.source.type", "Embedded")
    if source_type == "Volume" and (
        volume is None or (volume.claim_name is None) == (volume.host_path is None)
    ):
        raise SpecError(
            "spec.model.source.volume needs exactly one of persistentVolumeClaim or hostPath"
        )
    if source_type == "URI" and not src.get("uri"):
        raise SpecError("spec.model.source.uri is required when source.type is URI")
    dtype = _text(m.get("dtype"), "spec.model.dtype", DEFAULT_DTYPE)
    if dtype not in DTYPES:
        # The CRD's enum rejects it first; checked here too because the engine would exit at start.
        raise SpecError(f"spec.model.dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    ck = _obj(m.get("stateCheckpoints"), "spec.model.stateCheckpoints")
    interval = _int(ck.get("intervalTokens"), "spec.model.stateCheckpoints.intervalTokens",
                    DEFAULT_STATE_CHECKPOINT_INTERVAL)
    if interval % ENGINE_BLOCK_SIZE:
        raise SpecError(f"spec.model.stateCheckpoints.intervalTokens must be a multiple of the engines' block size "
                        f"({ENGINE_BLOCK_SIZE}), got {interval}")
    memory = _quantity(_text(ck.get("memory"), "spec.model.stateCheckpoints.memory", None)
                       or DEFAULT_STATE_CHECKPOINT_MEMORY, "spec.model.stateCheckpoints.memory")
    return Model(
        name=str(name),
        source_type=source_type,
        uri=_text(src.get("uri"), "spec.model.source.uri", None),
        volume=volume,
        format=_text(m.get("format"), "spec.model.format", "Auto"),
        dtype=dtype,
        state_checkpoint_interval=interval,
        state_checkpoint_memory=str(memory),
    )


def _client_auth(raw: Any) -> ClientAuth:
    a = _obj(raw, "spec.auth")
    secret = _text(a.get("apiKeysSecret"), "spec.auth.apiKeysSecret", None) or None
    isolate = _flag(a.get("isolateTenants"), "spec.auth.isolateTenants")
    if isolate and secret is None:
        raise SpecError("spec.auth.isolateTenants needs spec.auth.apiKeysSecret: tenants are told apart by their key")
    return ClientAuth(secret, _text(a.get("apiKeysKey"), "spec.auth.apiKeysKey", DEFAULT_API_KEYS_KEY)
                      or DEFAULT_API_KEYS_KEY, isolate)


def _admission(slo: Mapping[str, Any]) -> str:
    admission = _text(slo.get("admission"), "spec.slo.admission", DEFAULT_ADMISSION)
    if admission not in ADMISSIONS:
        raise SpecError(f"spec.slo.admission must be one of {', '.join(ADMISSIONS)}, got {admission!r}")
    missing = [f"spec.slo.{t}Ms" for t in fa.missing_targets(admission, slo.get("ttftMs"), slo.get("tpotMs"))]
    if missing:
        raise SpecError(f"spec.slo.admission {admission} admits against {' and '.join(missing)}: set "
                        f"{'them' if len(missing) > 1 else 'it'}, or set admission to FirstCome")
    return admission


def _gateway(router: Any) -> Gateway:
    r = _obj(router, "spec.router")
    mode = _text(r.get("mode"), "spec.router.mode", DEFAULT_ROUTER_MODE)
    if mode not in ROUTER_MODES:
        raise SpecError(f"spec.router.mode must be one of {', '.join(ROUTER_MODES)}, got {mode!r}")
    if r.get("gateway") is None:
        return Gateway(mode)
    if mode != "gateway":
        raise SpecError("spec.router.gateway is set but spec.router.mode is proxy: set mode: gateway, "
                        "or remove the gateway section")
    g = _obj(r.get("gateway"), "spec.router.gateway")
    failure = _text(g.get("failureMode"), "spec.router.gateway.failureMode", DEFAULT_FAILURE_MODE)
    if failure not in FAILURE_MODES:
        raise SpecError(f"spec.router.gateway.failureMode must be one of {', '.join(FAILURE_MODES)}, "
                        f"got {failure!r}")
    parent = None
    if g.get("parentRef") is not None:
        at = "spec.router.gateway.parentRef"
        p = _obj(g.get("parentRef"), at)
        name = _text(p.get("name"), f"{at}.name", None)
        if not name:
            raise SpecError(f"{at}.name is required: the Gateway the HTTPRoute attaches to")
        parent = ParentRef(name, _text(p.get("namespace"), f"{at}.namespace", None) or None,
                           _text(p.get("sectionName"), f"{at}.sectionName", None) or None)
    return Gateway(mode, parent, failure)


def _check_gateway(spec: InferenceSpec) -> None:
    """What gateway mode cannot serve (the CRD's CEL says the same at admission)."""
    if not spec.gateway.enabled:
        return
    if not spec.colocated:
        raise SpecError("spec.router.mode gateway serves colocated engines: set spec.prefill.replicas to 0 "
                        "(prefill/decode disaggregation needs the router's proxy mode)")
    if spec.auth.isolate_tenants:
        raise SpecError("spec.auth.isolateTenants needs spec.router.mode proxy: behind a gateway the engines "
                        "cannot tell tenants apart")


def parse_spec(spec: Mapping[str, Any]) -> InferenceSpec:
    """Typed, defaulted view of `.spec` (raises SpecError naming the bad field)."""
    spec = _obj(spec, "spec")
    slo = _obj(spec.get("slo"), "spec.slo")
    auto = _obj(spec.get("autoscaling"), "spec.autoscaling")
    out = InferenceSpec(
        model=_model(spec.get("model")),
        image=_text(spec.get("image"), "spec.image", DEFAULT_IMAGE),
        image_pull_policy=_text(spec.get("imagePullPolicy"), "spec.imagePullPolicy", DEFAULT_PULL_POLICY),
        prefill=_component("prefill", spec.get("prefill")),
        decode=_component("decode", spec.get("decode")),
        cache=_component("cache", spec.get("cache")),
        router=_component("router", spec.get("router")),
        slo=Slo(
            ttft_ms=_number(slo.get("ttftMs"), "spec.slo.ttftMs", None, 0.0, math.inf, keep_int=True),
            tpot_ms=_number(slo.get("tpotMs"), "spec.slo.tpotMs", None, 0.0, math.inf, keep_int=True),
            percentile=_number(slo.get("percentile"), "spec.slo.percentile", DEFAULT_PERCENTILE, 0.0, 100.0),
            admission=_admission(slo),
        ),
        autoscaling=Autoscaling(
            enabled=_flag(auto.get("enabled"), "spec.autoscaling.enabled"),
            kv_occupancy_target=_number(auto.get("kvOccupancyTarget"), "spec.autoscaling.kvOccupancyTarget",
                                        DEFAULT_KV_OCCUPANCY_TARGET, 0.0, 1.0),
            scale_up_stabilization_seconds=_int(auto.get("scaleUpStabilizationSeconds"),
                                                "spec.autoscaling.scaleUpStabilizationSeconds",
                                                DEFAULT_SCALE_UP_WINDOW_S),
            scale_down_stabilization_seconds=_int(auto.get("scaleDownStabilizationSeconds"),
                                                  "spec.autoscaling.scaleDownStabilizationSeconds",
                                                  DEFAULT_SCALE_DOWN_WINDOW_S),
            metrics_window_seconds=_int(auto.get("metricsWindowSeconds"), "spec.autoscaling.metricsWindowSeconds",
                                        DEFAULT_METRICS_WINDOW_S, minimum=1),
        ),
        auth=_client_auth(spec.get("auth")),
        gateway=_gateway(spec.get("router")),
    )
    _check_gateway(out)
    return out
