"""Building blocks of the CRD's OpenAPI schema, and its status and printer columns.

Small constructors for schema nodes (crd.py composes the spec from them) and
the parts of the CRD that describe what the operator writes rather than what
users ask for.
"""

from __future__ import annotations

from typing import Any

from . import spec as s
from .quantity import QUANTITY_PATTERN


def integer(description: str, default: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "integer", "format": "int32", "description": description}
    if default is not None:
        out["default"] = default
    return out


def number(description: str, default: float | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "number", "description": description}
    if default is not None:
        out["default"] = default
    return out


def string(description: str, default: str | None = None, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "string", "description": description, **extra}
    if default is not None:
        out["default"] = default
    return out


def quantity(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "x-kubernetes-int-or-string": True,
        "pattern": QUANTITY_PATTERN,
    }


def obj(description: str, props: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "object", "description": description, "properties": props, **extra}


def rule(rule: str, message: str) -> dict[str, str]:
    return {"rule": rule, "message": message}


def _component_status() -> dict[str, Any]:
    return obj(
        "Replica counts of one pool's Deployment.",
        {
            "desiredReplicas": integer("Replicas the spec asks for."),
            "replicas": integer("Pods that exist."),
            "updatedReplicas": integer("Pods running the current template."),
            "readyReplicas": integer("Pods passing readiness."),
            "availableReplicas": integer("Pods ready for minReadySeconds."),
            "ready": string("readyReplicas/desiredReplicas, for printing."),
        },
    )


def _autoscaling_status() -> dict[str, Any]:
    return obj(
        "The autoscaler's last decision for one pool.",
        {
            "desiredReplicas": integer("Replicas the autoscaler chose (the Deployment gets these)."),
            "currentReplicas": integer("Replicas when it decided."),
            "reason": string("CamelCase reason of the last decision."),
            "message": string("The signals behind it, against their targets."),
            "lastDecisionTime": string("When it last decided.", format="date-time"),
            "lastScaleTime": string("When it last changed the replicas.", format="date-time"),
            "drainingPod": string("The pod being drained before a scale-down, if any."),
        },
    )


def status_schema() -> dict[str, Any]:
    condition = obj(
        "A standard condition.",
        {
            "type": string("Ready, Progressing, Degraded or SLOMet."),
            "status": string("True, False or Unknown.", enum=["True", "False", "Unknown"]),
            "reason": string("CamelCase reason."),
            "message": string("Human-readable detail."),
            "lastTransitionTime": string("When status last changed.", format="date-time"),
            "observedGeneration": {"type": "integer", "format": "int64"},
        },
        required=["type", "status"],
    )
    return obj(
        "Observed state, written by the operator.",
        {
            "observedGeneration": {
                "type": "integer",
                "format": "int64",
                "description": "metadata.generation this status describes.",
            },
            "routerURL": string("In-cluster URL of the router Service."),
            "inferencePool": string("The InferencePool a gateway routes to (router.mode gateway)."),
            "scaleSelector": string(
                "Label selector of the decode pool's pods (the /scale subresource's selector)."),
            "components": obj(
                "Per-pool replica counts.", {c: _component_status() for c in s.COMPONENTS}
            ),
            "autoscaling": obj(
                "The autoscaler's view of each pool it resizes.",
                {c: _autoscaling_status() for c in ("prefill", "decode")},
            ),
            "conditions": {
                "type": "array",
                "items": condition,
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
            },
        },
    )


def printer_columns() -> list[dict[str, Any]]:
    cols: list[dict[str, Any]] = [
        {"name": "Model", "type": "string", "jsonPath": ".spec.model.name"}
    ]
    for c in s.COMPONENTS:
        cols.append(
            {"name": c.capitalize(), "type": "string", "jsonPath": f".status.components.{c}.ready"}
        )
    cols += [
        {"name": "Ready", "type": "string",
         "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    return cols
