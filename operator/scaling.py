"""Carrying out autoscaling decisions: scale up at once, scale down only after a drain.

`PoolScaler` is the sequencing, with every effect behind `ScaleIO` so tests
drive it with fakes. A scale-down goes:

  pick the victim (the ready pod with the least in-flight work)
  -> POST /admin/drain on it (it turns /ready to 503: the Service and the
     router stop sending; it finishes what it admitted)
  -> wait, at most the pool's terminationGracePeriodSeconds, for in_flight 0
  -> annotate it controller.kubernetes.io/pod-deletion-cost = lowest
  -> lower the pool's replicas by one, so the ReplicaSet removes exactly it.

A scale-up decided while a drain runs supersedes it: the victim's drain is
cancelled (DELETE /admin/drain: it serves again) and replicas go up at once.

A drain outlives the operator that started it. It is recorded on the victim
(annotation DRAIN_ANNOTATION, written before the engine is asked to drain, so a
drained engine always has one) and asked for with a lease the scaler renews on
every tick. A new leader's first tick of a pool `adopt`s what it finds: it
resumes the drain of a recorded pod whose engine still drains and undoes every
other record (undrain, drop the annotation). An engine nobody renews serves again
when its lease runs out, so no pod stays unready and unremoved for ever.

Invariants: at most one drain per pool at a time; replicas are lowered only
after the victim drained or its bound passed (then its own SIGTERM drain,
bounded by --drain-timeout, still lets its requests finish); a pool is never
lowered by more than one pod per drain, from the replicas it has when the
drain ends (never a count fixed earlier), so no undrained pod is removed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Protocol

from .autoscaler import Decision

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
# The lowest pod-deletion-cost (an int32): the ReplicaSet removes this pod first.
LOWEST_COST = -(2**31)
# A pod whose in-flight count is unknown is picked last.
UNKNOWN_LOAD = 1 << 30
# On a pod being drained: {"started": unix, "deadline": unix}; gone with the pod or the drain.
DRAIN_ANNOTATION = "serving.kvmesh.io/drain"


@dataclass(frozen=True)
class PodInfo:
    name: str
    endpoint: str  # host:port of the engine's HTTP API
    in_flight: int | None  # None: the pod did not answer
    token: str | None = field(default=None, repr=False, compare=False)  # the deployment's internal token


@dataclass(frozen=True)
class Drain:
    pod: PodInfo
    started: float
    deadline: float


def drain_record(d: Drain) -> str:
    """The DRAIN_ANNOTATION value for a drain."""
    return json.dumps({"started": d.started, "deadline": d.deadline}, sort_keys=True)


def parse_drain_record(pod: PodInfo, value: str) -> Drain | None:
    """The drain a DRAIN_ANNOTATION value records; None when it is not one (edited by hand)."""
    try:
        got = json.loads(value)
        return Drain(pod, float(got["started"]), float(got["deadline"]))
    except (ValueError, TypeError, KeyError):
        return None


class ScaleIO(Protocol):
    """The effects a PoolScaler needs (kube.py + HTTP in production, fakes in tests)."""

    def ready_pods(self, pool: str) -> list[PodInfo]: ...
    def start_drain(self, pod: PodInfo) -> None: ...  # asks again: renews the lease
    def cancel_drain(self, pod: PodInfo) -> None: ...
    def is_draining(self, pod: PodInfo) -> bool | None: ...  # None: gone or not answering
    def record_drain(self, pool: str, pod: PodInfo, record: str | None) -> None: ...  # None: drop it
    def recorded_drains(self, pool: str) -> list[tuple[PodInfo, str]]: ...  # (pod, annotation)
    def in_flight(self, pod: PodInfo) -> int | None: ...  # None: gone or not answering
    def mark_for_deletion(self, pool: str, pod: PodInfo) -> None: ...
    def set_replicas(self, pool: str, replicas: int) -> None: ...
    def event(self, pool: str, reason: str, message: str) -> None: ...


@dataclass
class PoolScaler:
    """One pool's scaling in progress. `step` is called on every autoscaler tick."""

    pool: str
    io: ScaleIO
    grace_s: float
    draining: Drain | None = None

    def step(self, decision: Decision, now: float) -> str:
        """Advance towards `decision`; returns what happened (for metrics, logs and tests):
        "hold", "scaled-up", "scaled-down" (nothing ready to drain), "drain-started",
        "draining" (still waiting), "drained" (victim idle or gone, then removed),
        "drain-timed-out" (the bound passed with requests left, removed anyway) or
        "drain-cancelled" (a scale-up superseded the drain: the victim serves again)."""
        if self.draining is not None:
            if decision.desired > decision.current:
                return self._cancel_drain(decision)
            return self._continue_drain(decision, now)
        if decision.desired > decision.current:
            self.io.set_replicas(self.pool, decision.desired)
            self.io.event(self.pool, "ScaledUp",
                          f"{self.pool}: {decision.current} -> {decision.desired} "
                          f"({decision.reason}: {decision.message})")
            return "scaled-up"
        if decision.desired < decision.current:
            return self._start_drain(decision, now)
        return "hold"

    def _start_drain(self, decision: Decision, now: float) -> str:
        pods = self.io.ready_pods(self.pool)
        if not pods:
            # Nothing ready to drain (pods starting or failing): lowering
            # replicas then cuts no request, the ReplicaSet removes unready pods first.
            self.io.set_replicas(self.pool, decision.current - 1)
            self.io.event(self.pool, "ScaledDown",
                          f"{self.pool}: {decision.current} -> {decision.current - 1} "
                          f"(no ready pod to drain; {decision.reason})")
            return "scaled-down"
        victim = min(pods, key=lambda p: (UNKNOWN_LOAD if p.in_flight is None else p.in_flight,
                                          p.name))
        drain = Drain(victim, now, now + self.grace_s)
        # Recorded first: whatever drains has a record a next leader finds.
        self.io.record_drain(self.pool, victim, drain_record(drain))
        try:
            self.io.start_drain(victim)
        except Exception:
            self._forget(victim)
            raise
        self.draining = drain
        self.io.event(self.pool, "DrainingPod",
                      f"{self.pool}: draining {victim.name} ({victim.in_flight} in flight) before "
                      f"{decision.current} -> {decision.current - 1} ({decision.reason}: "
                      f"{decision.message})")
        return "drain-started"

    def adopt(self) -> str | None:
        """Take over the drains recorded in this pool by an operator before this one (call once,
        before the first step): resume the oldest whose engine still drains, undo the others.
        Returns what happened, or None when nothing was recorded."""
        records = []
        for pod, value in self.io.recorded_drains(self.pool):
            d = parse_drain_record(pod, value)
            records.append((d.started if d else float("inf"), pod.name, pod, d))
        outcome = None
        for _, _, pod, d in sorted(records, key=lambda r: r[:2]):
            if d is not None and self.draining is None and self.io.is_draining(pod):
                self.draining = d
                outcome = "drain-resumed"
                self.io.event(self.pool, "DrainResumed",
                              f"{self.pool}: resuming the drain of {pod.name} that a previous operator "
                              "started")
                continue
            why = ("its record is unreadable" if d is None else "another drain is resumed" if self.draining
                   else "its engine no longer drains")
            undone = self._undrain(pod)
            outcome = outcome or "drain-undone"
            self.io.event(self.pool, "DrainUndone",
                          f"{self.pool}: dropped the drain of {pod.name} a previous operator left ({why}; {undone})")
        return outcome

    def _forget(self, pod: PodInfo) -> None:
        try:
            self.io.record_drain(self.pool, pod, None)
        except Exception:  # noqa: BLE001 - the pod is gone: so is its record
            pass

    def _undrain(self, pod: PodInfo) -> str:
        """Make `pod` serve again and drop its record; says how it went."""
        try:
            self.io.cancel_drain(pod)
            undone = f"{pod.name} serves again"
        except Exception as exc:  # noqa: BLE001 - gone or unreachable: the caller goes on regardless
            undone = f"could not undrain {pod.name} ({exc}); its drain lease runs out"
        self._forget(pod)
        return undone

    def _cancel_drain(self, decision: Decision) -> str:
        d = self.draining
        assert d is not None
        self.draining = None
        undone = self._undrain(d.pod)
        self.io.set_replicas(self.pool, decision.desired)
        self.io.event(self.pool, "DrainCancelled",
                      f"{self.pool}: scale-up {decision.current} -> {decision.desired} supersedes the drain "
                      f"({undone}; {decision.reason}: {decision.message})")
        return "drain-cancelled"

    def _continue_drain(self, decision: Decision, now: float) -> str:
        d = self.draining
        assert d is not None
        try:
            self.io.start_drain(d.pod)  # renews the lease
        except Exception:  # noqa: BLE001 - gone: in_flight says so next
            pass
        left = self.io.in_flight(d.pod)
        if left is not None and left > 0 and now < d.deadline:
            return "draining"
        target = decision.current - 1  # one pod fewer than now: exactly the drained one
        self.io.mark_for_deletion(self.pool, d.pod)
        self.io.set_replicas(self.pool, target)
        drained = left is None or left == 0
        if drained:
            how = f"drained in {now - d.started:.0f}s"
        else:
            how = (f"{left} request(s) still in flight after {self.grace_s:.0f}s; its SIGTERM "
                   "drain lets them finish")
        self.io.event(self.pool, "ScaledDown", f"{self.pool}: removed {d.pod.name} ({how}); "
                      f"replicas {target}")
        self.draining = None
        return "drained" if drained else "drain-timed-out"
