"""The InferenceDeployment CustomResourceDefinition, built as data.

The CRD is generated from this module so that its defaults come from the same
constants `spec.parse_spec` applies (spec.py). `python -m kvmesh.operator.generate`
rewrites crds/, the chart's copy and docs/crd-reference.md; a unit test fails
when a committed copy differs from what this module builds.

Validation lives in CEL rules (x-kubernetes-validations) so that a rejected
object comes back with a message that says what to change. Unknown fields are
dropped by the structural schema and rejected outright under strict field
validation (kubectl's default since 1.27; `fieldValidation=Strict` elsewhere).
"""

from __future__ import annotations

import copy
from typing import Any

from . import spec as s
from .schema import integer, number, obj, printer_columns, quantity, rule, status_schema, string

CRD_NAME = f"{s.PLURAL}.{s.GROUP}"


_TOLERATIONS = {
    "type": "array",
    "maxItems": 32,
    "description": "Tolerations added to the pool's pods (GPU pools always tolerate "
    "the nvidia.com/gpu taint as well).",
    "items": obj(
        "A core/v1 Toleration.",
        {
            "key": string("Taint key to tolerate; empty with operator Exists matches all."),
            "operator": string("Exists or Equal.", enum=["Exists", "Equal"]),
            "value": string("Taint value for operator Equal."),
            "effect": string(
                "NoSchedule, PreferNoSchedule or NoExecute; empty matches all.",
                enum=["NoSchedule", "PreferNoSchedule", "NoExecute"],
            ),
            "tolerationSeconds": {
                "type": "integer",
                "format": "int64",
                "description": "How long a NoExecute taint is tolerated.",
            },
        },
    ),
}
_NODE_SELECTOR = {
    "type": "object",
    "description": "Node labels the pool's pods must match.",
    "additionalProperties": {"type": "string"},
    "maxProperties": 32,
}


def _replica_rules() -> list[dict[str, str]]:
    return [
        rule("self.replicas >= 0", "replicas must not be negative"),
        rule(
            "!has(self.minReplicas) || self.minReplicas >= 0", "minReplicas must not be negative"
        ),
        rule(
            "!has(self.maxReplicas) || self.maxReplicas >= 1", "maxReplicas must be at least 1"
        ),
        rule(
            "!has(self.minReplicas) || !has(self.maxReplicas) || "
            "self.minReplicas <= self.maxReplicas",
            "minReplicas must be less than or equal to maxReplicas",
        ),
        rule(
            "!has(self.minReplicas) || self.minReplicas <= self.replicas",
            "replicas must be greater than or equal to minReplicas",
        ),
        rule(
            "!has(self.maxReplicas) || self.replicas <= self.maxReplicas",
            "replicas must be less than or equal to maxReplicas",
        ),
    ]


def _component(name: str, description: str) -> dict[str, Any]:
    gpu = name in ("prefill", "decode")
    resources: dict[str, Any] = {
        "cpu": quantity("CPU request per pod, e.g. '4' or '500m'."),
        "memory": quantity("Memory request (and limit) per pod, e.g. '16Gi'."),
    }
    rules = _replica_rules()
    if gpu:
        resources["gpus"] = integer("nvidia.com/gpu limit per pod; 0 runs on CPU.", s.DEFAULT_GPUS)
        rules.append(rule("self.resources.gpus >= 0", "resources.gpus must not be negative"))
    props: dict[str, Any] = {
        "replicas": integer("Number of pods.", s.DEFAULT_REPLICAS),
        "minReplicas": integer("Lower bound for the autoscaler (unset: replicas)."),
        "maxReplicas": integer("Upper bound for the autoscaler (unset: replicas)."),
        "resources": obj("Per-pod resources.", resources, default={}),
        "nodeSelector": _NODE_SELECTOR,
        "tolerations": _TOLERATIONS,
        "terminationGracePeriodSeconds": {
            **integer(
                "Time a pod gets to drain in-flight work after SIGTERM.",
                s.DEFAULT_GRACE_S[name],
            ),
            "format": "int64",
        },
    }
    rules.append(
        rule(
            "self.terminationGracePeriodSeconds >= 0",
            "terminationGracePeriodSeconds must not be negative",
        )
    )
    if name == "cache":
        props["memory"] = string(
            "KV capacity of each cache node (host memory for KV blocks), e.g. '64Gi'.",
            s.DEFAULT_CACHE_MEMORY,
            pattern=r"^[0-9]+(\.[0-9]+)?([KMGTPE]i|[kMGTPE])?$",
        )
    if name == "router":
        props["policy"] = string(
            "How the router picks an engine.", s.DEFAULT_ROUTER_POLICY, enum=list(s.ROUTER_POLICIES)
        )
        props["mode"] = string(
            "proxy: the router Service is the entry point. gateway: a Gateway API Inference Extension "
            "gateway is; the operator renders an InferencePool whose endpoint picker is the router "
            "(kvmesh router --ext-proc-port), and the gateway sends each request to the engine pod it picks.",
            s.DEFAULT_ROUTER_MODE, enum=list(s.ROUTER_MODES))
        props["gateway"] = _router_gateway()
        rules.append(rule("self.mode == 'gateway' || !has(self.gateway)",
                          "router.gateway needs router.mode: gateway"))
    return obj(description, props, default={}, **{"x-kubernetes-validations": rules})


def _router_gateway() -> dict[str, Any]:
    return obj(
        "Gateway mode settings (router.mode gateway only).",
        {
            "parentRef": obj(
                "The Gateway to attach to: the operator renders an HTTPRoute sending every path of it to the "
                "deployment's InferencePool. Without it, route to the pool <name>-pool yourself.",
                {
                    "name": string("The Gateway's name.", minLength=1, maxLength=253),
                    "namespace": string("The Gateway's namespace (default: this one; another needs a "
                                        "ReferenceGrant there).", maxLength=63),
                    "sectionName": string("One listener of the Gateway.", maxLength=253),
                },
                required=["name"],
            ),
            "failureMode": string(
                "What the gateway does while the endpoint picker does not answer: FailClose refuses the "
                "request, FailOpen sends it to an engine of the gateway's choosing.",
                s.DEFAULT_FAILURE_MODE, enum=list(s.FAILURE_MODES)),
        },
    )


def _model() -> dict[str, Any]:
    volume = obj(
        "A volume holding the weights; exactly one of persistentVolumeClaim or hostPath.",
        {
            "persistentVolumeClaim": obj(
                "An existing PVC, mounted read-only.",
                {"claimName": string("Name of the PVC in the same namespace.", minLength=1)},
                required=["claimName"],
            ),
            "hostPath": obj(
                "A directory on the node, mounted read-only.",
                {"path": string("Absolute path on the node.", minLength=1, pattern="^/")},
                required=["path"],
            ),
            "path": string(
                "File (GGUF) or directory (safetensors) inside the volume; empty: the volume root.",
                maxLength=1024,
            ),
        },
        **{
            "x-kubernetes-validations": [
                rule(
                    "has(self.persistentVolumeClaim) != has(self.hostPath)",
                    "set exactly one of persistentVolumeClaim or hostPath",
                ),
                rule(
                    "!has(self.path) || !self.path.contains('..')",
                    "path must stay inside the volume (no '..')",
                ),
            ]
        },
    )
    source = obj(
        "Where the engine loads the weights from.",
        {
            "type": string(
                "Embedded: the model shipped in the image; Volume: a mounted volume; "
                "URI: a GGUF or safetensors location the engine downloads.",
                "Embedded",
                enum=list(s.SOURCE_TYPES),
            ),
            "volume": volume,
            "uri": string(
                "Location of a GGUF file or safetensors repository.", minLength=1, maxLength=2048
            ),
        },
        default={},
        **{
            "x-kubernetes-validations": [
                rule(
                    "self.type != 'Volume' || has(self.volume)",
                    "source.volume is required when source.type is Volume",
                ),
                rule(
                    "self.type != 'URI' || has(self.uri)",
                    "source.uri is required when source.type is URI",
                ),
                rule(
                    "self.type == 'Volume' || !has(self.volume)",
                    "source.volume is only allowed when source.type is Volume",
                ),
                rule(
                    "self.type == 'URI' || !has(self.uri)",
                    "source.uri is only allowed when source.type is URI",
                ),
            ]
        },
    )
    return obj(
        "The model to serve.",
        {
            "name": string(
                "Model name, served as the OpenAI `model` id (e.g. smollm2-135m-instruct).",
                minLength=1,
                maxLength=253,
            ),
            "format": string("Weights format.", "Auto", enum=list(s.MODEL_FORMATS)),
            "dtype": string(
                "Dtype of the engines' weights, activations and KV blocks (`kvmesh serve --dtype`); "
                "`auto` picks what each node computes natively (bfloat16 on CPUs with AVX512_BF16 or "
                "AMX-BF16 and GPUs from sm_80, float32 on other CPUs, float16 on older GPUs). Prefill "
                "and decode pools always share the field; set a dtype when they may land on different "
                "kinds of node, since a KV handoff needs the same dtype on both sides.",
                s.DEFAULT_DTYPE,
                enum=list(s.DTYPES),
            ),
            "source": source,
            "stateCheckpoints": obj(
                "Recurrent-state checkpoints of hybrid models (gated DeltaNet or Mamba layers beside attention): "
                "a prefix hit on such a model needs a checkpoint at its end (docs/engine.md, 'Hybrid models'). "
                "Models without recurrent layers ignore it.",
                {
                    "intervalTokens": integer(
                        "A checkpoint every this many prompt tokens (besides the end of each prompt and "
                        "generation); a multiple of 16, the engines' block size; 0: only those ends.",
                        s.DEFAULT_STATE_CHECKPOINT_INTERVAL),
                    "memory": quantity("Host memory each engine keeps checkpoints in (their LRU pool); "
                                       "0 turns checkpoints off. Default " + s.DEFAULT_STATE_CHECKPOINT_MEMORY + "."),
                },
                default={},
                **{"x-kubernetes-validations": [
                    rule(f"self.intervalTokens >= 0 && self.intervalTokens % {s.ENGINE_BLOCK_SIZE} == 0",
                         f"stateCheckpoints.intervalTokens must be 0 or a multiple of {s.ENGINE_BLOCK_SIZE}"),
                ]},
            ),
        },
        required=["name"],
    )


def _slo() -> dict[str, Any]:
    return obj(
        "Latency objectives the autoscaler and the status report against.",
        {
            "ttftMs": integer("Time to first token, milliseconds."),
            "tpotMs": integer("Time per output token, milliseconds."),
            "percentile": number("Percentile the objectives apply to.", s.DEFAULT_PERCENTILE),
            "admission": string(
                "How the engines admit waiting requests. FirstCome: in arrival order. TTFTFirst: those "
                "that can still get their first token within ttftMs go first. TPOTGated: TTFTFirst, and "
                "while requests run at most one admission per step and none while the running streams' "
                "time per token averages 75% of tpotMs or more (TTFT rises instead of TPOT under "
                "overload; docs/operator.md).",
                s.DEFAULT_ADMISSION, enum=list(s.ADMISSIONS)),
        },
        default={},
        **{
            "x-kubernetes-validations": [
                rule("!has(self.ttftMs) || self.ttftMs > 0", "slo.ttftMs must be positive"),
                rule("!has(self.tpotMs) || self.tpotMs > 0", "slo.tpotMs must be positive"),
                rule("!has(self.admission) || self.admission == 'FirstCome' || has(self.ttftMs)",
                     "slo.admission TTFTFirst and TPOTGated need slo.ttftMs"),
                rule("!has(self.admission) || self.admission != 'TPOTGated' || has(self.tpotMs)",
                     "slo.admission TPOTGated needs slo.tpotMs"),
                rule(
                    "self.percentile > 0.0 && self.percentile <= 100.0",
                    "slo.percentile must be in (0, 100]",
                ),
            ]
        },
    )


def _autoscaling() -> dict[str, Any]:
    return obj(
        "Autoscaling of the prefill and decode pools within [minReplicas, maxReplicas].",
        {
            "enabled": {"type": "boolean", "default": False, "description": "Turn autoscaling on."},
            "kvOccupancyTarget": number(
                "Target fraction of decode KV blocks in use.", s.DEFAULT_KV_OCCUPANCY_TARGET
            ),
            "scaleUpStabilizationSeconds": integer(
                "Window over which a scale-up must keep being wanted.", s.DEFAULT_SCALE_UP_WINDOW_S
            ),
            "scaleDownStabilizationSeconds": integer(
                "Window over which a scale-down must keep being wanted.",
                s.DEFAULT_SCALE_DOWN_WINDOW_S,
            ),
            "metricsWindowSeconds": integer(
                "Window the metrics are averaged over.", s.DEFAULT_METRICS_WINDOW_S
            ),
        },
        default={},
        **{
            "x-kubernetes-validations": [
                rule(
                    "self.kvOccupancyTarget > 0.0 && self.kvOccupancyTarget <= 1.0",
                    "autoscaling.kvOccupancyTarget must be in (0, 1]",
                ),
                rule(
                    "self.scaleUpStabilizationSeconds >= 0 && "
                    "self.scaleDownStabilizationSeconds >= 0",
                    "autoscaling stabilization windows must not be negative",
                ),
                rule(
                    "self.metricsWindowSeconds > 0", "autoscaling.metricsWindowSeconds must be positive"
                ),
            ]
        },
    )


def _auth() -> dict[str, Any]:
    return obj(
        "Client authentication at the router. The deployment's internal token (Secret <name>-auth) "
        "is created by the operator and needs no field.",
        {
            "apiKeysSecret": string("A Secret in this namespace holding the API keys clients must send as "
                                    "'Authorization: Bearer <key>', one per line; without it the OpenAI "
                                    "endpoints are open to whoever reaches the router."),
            "apiKeysKey": string("The Secret's key that holds the keys.", s.DEFAULT_API_KEYS_KEY, minLength=1),
            "isolateTenants": {"type": "boolean", "default": False,
                               "description": "A prefix cache per API key: requests share cached KV only with "
                                              "requests made with the same key."},
        },
        default={},
        **{
            "x-kubernetes-validations": [
                rule("!self.isolateTenants || has(self.apiKeysSecret)",
                     "auth.isolateTenants needs auth.apiKeysSecret"),
            ]
        },
    )


def _spec_schema() -> dict[str, Any]:
    props = {
        "model": _model(),
        "image": string("Engine image; every pool runs it with different role arguments.",
                      s.DEFAULT_IMAGE, minLength=1),
        "imagePullPolicy": string("Pull policy for the engine image.", s.DEFAULT_PULL_POLICY,
                                enum=list(s.PULL_POLICIES)),
        "prefill": _component("prefill", "Prefill pool (GPU). replicas: 0 = colocated serving."),
        "decode": _component("decode", "Decode pool (GPU); runs both phases when prefill is 0."),
        "cache": _component("cache", "Cache nodes holding KV blocks in host memory (CPU)."),
        "router": _component("router", "The OpenAI-compatible entry point (CPU)."),
        "slo": _slo(),
        "autoscaling": _autoscaling(),
        "auth": _auth(),
    }
    return obj(
        "Desired state of one model's serving pools.",
        props,
        required=["model"],
        **{
            "x-kubernetes-validations": [
                rule(
                    "self.decode.replicas >= 1 || self.prefill.replicas == 0",
                    "decode.replicas must be at least 1 while prefill.replicas > 0",
                ),
                rule("self.router.mode != 'gateway' || self.prefill.replicas == 0",
                     "router.mode gateway serves colocated engines: set prefill.replicas to 0 "
                     "(prefill/decode disaggregation needs router.mode proxy)"),
                rule("self.router.mode != 'gateway' || !self.auth.isolateTenants",
                     "auth.isolateTenants needs router.mode proxy"),
            ]
        },
    )


def _defaults_of(schema: dict[str, Any]) -> dict[str, Any]:
    """The object an empty value of `schema` defaults to, nested defaults included."""
    out = {}
    for name, sub in schema.get("properties", {}).items():
        if "default" in sub:
            out[name] = copy.deepcopy(sub["default"])
    return out


def _fill_object_defaults(schema: dict[str, Any]) -> None:
    """Replace each `default: {}` with the fully defaulted object, bottom-up.

    The API server validates a default against the schema's CEL rules as is,
    without applying the nested defaults first, so an empty default would fail
    rules such as `self.replicas >= 0`.
    """
    for sub in schema.get("properties", {}).values():
        _fill_object_defaults(sub)
    if schema.get("default") == {} and schema.get("type") == "object":
        schema["default"] = _defaults_of(schema)


# /scale drives the decode pool: it exists in every topology (it serves both phases when
# prefill.replicas is 0) and it is the pool whose size generic external signals (running
# requests, KV occupancy, accelerator use) track. A CRD has one scale subresource, so the
# prefill pool is scaled through spec.prefill.replicas. The selector names the decode pods, for
# an HPA's resource metrics and for KEDA. Ownership (docs/operator.md): with autoscaling off,
# spec.decode.replicas is the pool's size and the operator applies it, so an external scaler
# writing it through /scale is never reverted; with autoscaling on, the operator's autoscaler
# owns the size and spec.decode.replicas is only the starting point.
SCALE_SUBRESOURCE = {
    "specReplicasPath": ".spec.decode.replicas",
    "statusReplicasPath": ".status.components.decode.replicas",
    "labelSelectorPath": ".status.scaleSelector",
}


def build_crd() -> dict[str, Any]:
    """The CRD manifest. Pure: same output on every call."""
    root = {
        "type": "object",
        "description": "A model served by kvmesh: prefill, decode, cache and router pools.",
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": _spec_schema(),
            "status": status_schema(),
        },
        "required": ["spec"],
        "x-kubernetes-validations": [
            # Children are named <name>-<component> and Services must be
            # DNS-1035 labels (<= 63 chars, starting with a letter).
            rule("size(self.metadata.name) <= 55", "metadata.name must be at most 55 characters"),
            rule(
                "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
                "metadata.name must start with a letter and contain only a-z, 0-9 and '-'",
            ),
        ],
    }
    _fill_object_defaults(root)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME, "labels": {"app.kubernetes.io/part-of": "kvmesh"}},
        "spec": {
            "group": s.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": s.KIND,
                "listKind": f"{s.KIND}List",
                "plural": s.PLURAL,
                "singular": s.SINGULAR,
                "shortNames": list(s.SHORT_NAMES),
                "categories": ["kvmesh"],
            },
            "versions": [
                {
                    "name": s.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}, "scale": SCALE_SUBRESOURCE},
                    "additionalPrinterColumns": printer_columns(),
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }
