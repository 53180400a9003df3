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

Invariants: at most one drain per pool at a time; replicas are lowered only
after the victim drained or its bound passed (then its own SIGTERM drain,
bounded by --drain-timeout, still lets its requests finish); a pool is never
lowered by more than one pod per drain, from the replicas it has when the
drain ends (never a count fixed earlier), so no undrained pod is removed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .autoscaler import Decision

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
# The lowest pod-deletion-cost (an int32): the ReplicaSet removes this pod first.
LOWEST_COST = -(2**31)
# A pod whose in-flight count is unknown is picked last.
UNKNOWN_LOAD = 1 << 30


@dataclass(frozen=True)
class PodInfo:
    name: str
    endpoint: str  # host:port of the engine's HTTP API
    in_flight: int | None  # None: the pod did not answer


class ScaleIO(Protocol):
    """The effects a PoolScaler needs (kube.py + HTTP in production, fakes in tests)."""

    def ready_pods(self, pool: str) -> list[PodInfo]: ...
    def start_drain(self, pod: PodInfo) -> None: ...
    def cancel_drain(self, pod: PodInfo) -> None: ...
    def in_flight(self, pod: PodInfo) -> int | None: ...  # None: gone or not answering
    def mark_for_deletion(self, pool: str, pod: PodInfo) -> None: ...
    def set_replicas(self, pool: str, replicas: int) -> None: ...
    def event(self, pool: str, reason: str, message: str) -> None: ...


@dataclass
class Drain:
    pod: PodInfo
    started: float
    deadline: float


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
        self.io.start_drain(victim)
        self.draining = Drain(victim, now, now + self.grace_s)
        self.io.event(self.pool, "DrainingPod",
                      f"{self.pool}: draining {victim.name} ({victim.in_flight} in flight) before "
                      f"{decision.current} -> {decision.current - 1} ({decision.reason}: "
                      f"{decision.message})")
        return "drain-started"

    def _cancel_drain(self, decision: Decision) -> str:
        d = self.draining
        assert d is not None
        self.draining = None
        try:
            self.io.cancel_drain(d.pod)
            undone = f"{d.pod.name} serves again"
        except Exception as exc:  # noqa: BLE001 - gone or unreachable: the scale-up must still happen
            undone = f"could not undrain {d.pod.name} ({exc}); it stays unready until replaced"
        self.io.set_replicas(self.pool, decision.desired)
        self.io.event(self.pool, "DrainCancelled",
                      f"{self.pool}: scale-up {decision.current} -> {decision.desired} supersedes the drain "
                      f"({undone}; {decision.reason}: {decision.message})")
        return "drain-cancelled"

    def _continue_drain(self, decision: Decision, now: float) -> str:
        d = self.draining
        assert d is not None
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
