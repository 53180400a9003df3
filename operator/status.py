"""Status of an InferenceDeployment from its children (pure functions).

The status only reports what the children say: a pool counts as ready when
its Deployment has observed its latest spec and has at least the desired
number of updated, ready pods. Conditions follow the Kubernetes conventions:

- Ready:       True when every pool is ready.
- Progressing: True while some pool is rolling out or scaling.
- Degraded:    True when the operator cannot make progress on its own
               (invalid spec, a failed apply, a missing child, crash-looping
               pods, a rollout past its deadline, pods that cannot be created).

A crash-looping pool is Degraded from its pods' container statuses, as soon as
a pass sees them (a pass runs at least every resync period), instead of after
the Deployment's progressDeadlineSeconds (600 s): a container waiting in
CrashLoopBackOff, or not ready after CRASH_RESTARTS restarts or more. A pod
that restarted that often but serves again (ready) is not crash-looping.

`lastTransitionTime` only moves when a condition's status changes, so
recomputing an unchanged status yields an identical object and the operator
can skip the write.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from . import spec as s
from .autoscaler import effective_replicas
from .gateway import pool_name
from .render import Owner, router_url, selector_labels

CONDITION_TYPES = ("Ready", "Progressing", "Degraded")
# Restarts of a container that is still not ready, from which its pod counts as crash-looping
# even before the kubelet's back-off reports CrashLoopBackOff (it alternates with Running/Error).
CRASH_RESTARTS = 3


def crash_looping(pods: Iterable[Mapping[str, Any]], restarts: int = CRASH_RESTARTS) -> list[str]:
    """One line per crash-looping container of `pods` (Pod objects as dicts), sorted.

    E.g. "llm-decode-7d9f-abcde/engine: CrashLoopBackOff, 4 restarts, last exit 1 (Error)".
    Terminating pods are skipped (their restarts no longer matter).
    """
    out = []
    for pod in pods:
        meta, st = pod.get("metadata") or {}, pod.get("status") or {}
        if meta.get("deletionTimestamp"):
            continue
        for c in list(st.get("initContainerStatuses") or ()) + list(st.get("containerStatuses") or ()):
            waiting = ((c.get("state") or {}).get("waiting") or {}).get("reason")
            count = int(c.get("restartCount") or 0)
            if waiting != "CrashLoopBackOff" and (count < restarts or c.get("ready")):
                continue
            last = (c.get("lastState") or {}).get("terminated") or {}
            why = [waiting or "restarting", f"{count} restarts"]
            if last:
                why.append(f"last exit {last.get('exitCode')} ({last.get('reason') or 'unknown'})")
            out.append(f"{meta.get('name')}/{c.get('name')}: {', '.join(why)}")
    return sorted(out)


@dataclass(frozen=True)
class PoolState:
    """One pool as read from its Deployment (None fields: the child is missing)."""

    component: str
    desired: int
    exists: bool
    current: bool = False  # the Deployment controller has seen our latest spec
    replicas: int = 0
    updated: int = 0
    ready: int = 0
    available: int = 0
    deadline_exceeded: bool = False
    replica_failure: str | None = None

    @property
    def is_ready(self) -> bool:
        return (
            self.exists
            and self.current
            and self.updated >= self.desired
            and self.ready >= self.desired
        )

    @property
    def is_settled(self) -> bool:
        """Ready and no surplus (old or extra) pods left."""
        return self.is_ready and self.replicas == self.desired


def _condition(deployment: Mapping[str, Any], ctype: str) -> Mapping[str, Any] | None:
    for cond in (deployment.get("status") or {}).get("conditions") or ():
        if cond.get("type") == ctype:
            return cond
    return None


def pool_state(component: str, desired: int, deployment: Mapping[str, Any] | None) -> PoolState:
    if deployment is None:
        return PoolState(component, desired, exists=False)
    st = deployment.get("status") or {}
    meta = deployment.get("metadata") or {}
    current = (
        int(st.get("observedGeneration") or 0) >= int(meta.get("generation") or 0)
        and int((deployment.get("spec") or {}).get("replicas", 1)) == desired
    )
    progressing = _condition(deployment, "Progressing")
    failure = _condition(deployment, "ReplicaFailure")
    return PoolState(
        component,
        desired,
        exists=True,
        current=current,
        replicas=int(st.get("replicas") or 0),
        updated=int(st.get("updatedReplicas") or 0),
        ready=int(st.get("readyReplicas") or 0),
        available=int(st.get("availableReplicas") or 0),
        deadline_exceeded=bool(
            progressing
            and progressing.get("status") == "False"
            and progressing.get("reason") == "ProgressDeadlineExceeded"
        ),
        replica_failure=(failure.get("message") or "ReplicaFailure")
        if failure and failure.get("status") == "True"
        else None,
    )


def _set(
    previous: Mapping[str, Mapping[str, Any]],
    ctype: str,
    status: bool,
    reason: str,
    message: str,
    generation: int,
    now: str,
) -> dict[str, Any]:
    value = "True" if status else "False"
    old = previous.get(ctype)
    changed = old is None or old.get("status") != value
    return {
        "type": ctype,
        "status": value,
        "reason": reason,
        "message": message,
        "lastTransitionTime": now if changed else old.get("lastTransitionTime", now),
        "observedGeneration": generation,
    }


def router_ready(pools: list[PoolState]) -> bool:
    return any(p.component == "router" and p.exists and p.ready > 0 for p in pools)


def compute_status(
    obj: Mapping[str, Any],
    deployments: Mapping[str, Mapping[str, Any] | None],
    now: str,
    error: str | None = None,
    error_reason: str = "ApplyFailed",
    pods: Mapping[str, Iterable[Mapping[str, Any]]] | None = None,
) -> dict[str, Any]:
    """The full `.status` for `obj` given its Deployments (and, optionally, pods) by component.

    `error` is a failure of the operator's own (render or apply) step; it makes
    the object Degraded with `error_reason` and the message verbatim.
    `now` is an RFC 3339 timestamp used only for conditions that change.
    """
    owner = Owner.from_object(obj)
    previous = {
        c.get("type"): c for c in ((obj.get("status") or {}).get("conditions") or ())
    }
    try:
        spec = s.parse_spec(obj.get("spec") or {})
        desired = effective_replicas(spec, obj.get("status"))
        gateway_mode = spec.gateway.enabled
    except s.SpecError as exc:
        desired = {c: 0 for c in s.COMPONENTS}
        error, error_reason, gateway_mode = str(exc), "InvalidSpec", False
    pools = [pool_state(c, desired[c], deployments.get(c)) for c in s.COMPONENTS]

    not_ready = [p for p in pools if not p.is_ready]
    moving = [p for p in pools if p.exists and not p.is_settled]
    missing = [p.component for p in pools if not p.exists]
    stuck = [p.component for p in pools if p.deadline_exceeded]
    failing = [f"{p.component}: {p.replica_failure}" for p in pools if p.replica_failure]
    crashing = [f"{c}: " + "; ".join(lines) for c in s.COMPONENTS
                if (lines := crash_looping((pods or {}).get(c) or ()))]

    def summary(items: list[PoolState]) -> str:
        return "; ".join(f"{p.component} {p.ready}/{p.desired} ready" for p in items)

    if error:
        degraded = (True, error_reason, error)
    elif missing:
        degraded = (True, "ChildMissing", "missing Deployment for " + ", ".join(missing))
    elif crashing:
        degraded = (True, "CrashLoopBackOff", " | ".join(crashing))
    elif stuck:
        degraded = (True, "ProgressDeadlineExceeded", "rollout stuck for " + ", ".join(stuck))
    elif failing:
        degraded = (True, "ReplicaFailure", "; ".join(failing))
    else:
        degraded = (False, "AsExpected", "")

    gen = owner.generation
    conditions = [
        _set(previous, "Ready", not not_ready,
             "PoolsNotReady" if not_ready else "AllPoolsReady",
             summary(not_ready) if not_ready else summary(pools), gen, now),
        _set(previous, "Progressing", bool(moving),
             "RollingOut" if moving else "Stable",
             summary(moving) if moving else "all pools at their desired state", gen, now),
        _set(previous, "Degraded", degraded[0], degraded[1], degraded[2], gen, now),
    ]
    # Conditions other writers own (SLOMet, from the autoscaler) are kept as they are:
    # a merge patch replaces the whole list.
    conditions += [c for t, c in previous.items() if t not in CONDITION_TYPES]
    return {
        "observedGeneration": gen,
        # Only while a router pod can answer: a URL nothing serves misleads clients.
        "routerURL": router_url(owner) if router_ready(pools) else None,
        # Once applied: a pass that failed to apply it reports the error instead.
        "inferencePool": pool_name(owner) if gateway_mode and not error else None,
        # The /scale subresource's labelSelectorPath (crd.SCALE_SUBRESOURCE): the decode pods.
        "scaleSelector": ",".join(f"{k}={v}" for k, v in selector_labels(owner, "decode").items()),
        "components": {
            p.component: {
                "desiredReplicas": p.desired,
                "replicas": p.replicas,
                "updatedReplicas": p.updated,
                "readyReplicas": p.ready,
                "availableReplicas": p.available,
                "ready": f"{p.ready}/{p.desired}",
            }
            for p in pools
        },
        "conditions": conditions,
    }


def status_changed(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> bool:
    """Whether writing `new` would change anything (keys the operator owns only)."""
    old = old or {}
    return any(old.get(k) != v for k, v in new.items())
