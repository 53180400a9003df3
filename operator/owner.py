"""Who a child object belongs to: its owner, name, labels and ownerReferences (pure).

Every child of an InferenceDeployment is named ``<name>-<component>`` and carries the owner label
and a controller ownerReference, so the garbage collector removes it with the CR and the
operator's watches find it by label.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from . import spec as s

OWNER_LABEL = "serving.kvmesh.io/inference-deployment"
MANAGED_BY = "kvmesh-operator"


@dataclass(frozen=True)
class Owner:
    """The CR a set of children belongs to."""

    name: str
    namespace: str
    uid: str
    generation: int = 0

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> Owner:
        meta = obj["metadata"]
        return cls(meta["name"], meta["namespace"], meta["uid"], int(meta.get("generation", 0)))


def child_name(owner: Owner, component: str) -> str:
    return f"{owner.name}-{component}"


def selector_labels(owner: Owner, component: str) -> dict[str, str]:
    """Immutable Deployment selector: never add keys here after release."""
    return {
        "app.kubernetes.io/name": "kvmesh",
        "app.kubernetes.io/instance": owner.name,
        "app.kubernetes.io/component": component,
    }


def labels(owner: Owner, component: str | None = None) -> dict[str, str]:
    out = {
        "app.kubernetes.io/name": "kvmesh",
        "app.kubernetes.io/instance": owner.name,
        "app.kubernetes.io/part-of": "kvmesh",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        OWNER_LABEL: owner.name,
    }
    if component:
        out["app.kubernetes.io/component"] = component
    return out


def meta(owner: Owner, name: str, component: str | None) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": labels(owner, component),
        "ownerReferences": [
            {
                "apiVersion": f"{s.GROUP}/{s.VERSION}",
                "kind": s.KIND,
                "name": owner.name,
                "uid": owner.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
    }
