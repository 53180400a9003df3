"""Leader election on a coordination.k8s.io/v1 Lease, so that several operator
replicas never reconcile at the same time.

The protocol is the one client-go's leaderelection uses: a candidate takes
the Lease when it is free or its holder's renewTime is older than
leaseDurationSeconds; the holder renews it every `renew_period`; every write
carries the resourceVersion it read, so of two candidates racing for an
expired Lease the API server accepts exactly one. A leader that cannot renew
within `renew_deadline` stops leading before its Lease can expire, so there is
never a moment with two leaders (given clocks that agree within
lease_duration - renew_deadline).

`decide` is the pure part; `LeaseElector` does the reads and writes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Mapping

log = logging.getLogger("kvmesh.operator.leader")


@dataclass(frozen=True)
class LeaseRecord:
    holder: str | None
    renew_time: datetime | None
    duration_s: int
    transitions: int = 0
    acquire_time: datetime | None = None


@dataclass(frozen=True)
class Decision:
    action: str  # "acquire", "renew" or "wait"
    record: LeaseRecord | None = None  # what to write for acquire/renew


def decide(current: LeaseRecord | None, identity: str, now: datetime, duration_s: int) -> Decision:
    """What a candidate named `identity` should do at `now` given the Lease it read."""
    if current is not None and current.holder == identity:
        return Decision("renew", LeaseRecord(identity, now, duration_s, current.transitions,
                                             current.acquire_time or now))
    free = (
        current is None
        or not current.holder
        or current.renew_time is None
        or now >= current.renew_time + timedelta(seconds=current.duration_s)
    )
    if not free:
        return Decision("wait")
    transitions = 0 if current is None else current.transitions + (1 if current.holder else 0)
    return Decision("acquire", LeaseRecord(identity, now, duration_s, transitions, now))


def _parse_time(value: Any) -> datetime | None:
    if value is None or isinstance(value, datetime):
        return value
    return datetime.fromisoformat(str(value).replace("Z", "+00:00"))


def _fmt_time(value: datetime | None) -> str | None:
    if value is None:
        return None
    return value.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def record_from_lease(spec: Mapping[str, Any] | None) -> LeaseRecord | None:
    if spec is None:
        return None
    return LeaseRecord(
        holder=spec.get("holderIdentity"),
        renew_time=_parse_time(spec.get("renewTime")),
        duration_s=int(spec.get("leaseDurationSeconds") or 15),
        transitions=int(spec.get("leaseTransitions") or 0),
        acquire_time=_parse_time(spec.get("acquireTime")),
    )


def lease_spec(record: LeaseRecord) -> dict[str, Any]:
    return {
        "holderIdentity": record.holder,
        "leaseDurationSeconds": record.duration_s,
        "renewTime": _fmt_time(record.renew_time),
        "acquireTime": _fmt_time(record.acquire_time),
        "leaseTransitions": record.transitions,
    }


class LeaseConflict(Exception):
    """Another candidate wrote the Lease between our read and our write."""


@dataclass
class LeaseStore:
    """Reads and writes one Lease through the kubernetes client."""

    namespace: str
    name: str

    def _api(self):
        from kubernetes import client

        from .kube import api_client

        return client.CoordinationV1Api(api_client())

    def read(self) -> tuple[LeaseRecord | None, str | None]:
        from kubernetes.client.rest import ApiException

        try:
            lease = self._api().read_namespaced_lease(self.name, self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None, None
            raise
        body = lease.to_dict()
        spec = body.get("spec") or {}
        camel = {
            "holderIdentity": spec.get("holder_identity"),
            "renewTime": spec.get("renew_time"),
            "leaseDurationSeconds": spec.get("lease_duration_seconds"),
            "leaseTransitions": spec.get("lease_transitions"),
            "acquireTime": spec.get("acquire_time"),
        }
        return record_from_lease(camel), body["metadata"]["resource_version"]

    def write(self, record: LeaseRecord, resource_version: str | None) -> None:
        from kubernetes.client.rest import ApiException

        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": lease_spec(record),
        }
        try:
            if resource_version is None:
                self._api().create_namespaced_lease(self.namespace, body)
            else:
                body["metadata"]["resourceVersion"] = resource_version
                self._api().replace_namespaced_lease(self.name, self.namespace, body)
        except ApiException as exc:
            if exc.status in (409, 422):
                raise LeaseConflict(str(exc.reason)) from exc
            raise


@dataclass
class LeaseElector:
    """Acquire, hold and release one Lease from an asyncio program."""

    store: LeaseStore
    identity: str
    lease_duration_s: int = 15
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0
    clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc)
    is_leader: bool = False

    async def _try(self) -> bool:
        record, rv = await asyncio.to_thread(self.store.read)
        decision = decide(record, self.identity, self.clock(), self.lease_duration_s)
        if decision.action == "wait":
            return False
        try:
            await asyncio.to_thread(self.store.write, decision.record, rv)
        except LeaseConflict:
            return False
        if decision.action == "acquire":
            log.info("acquired lease %s/%s as %s", self.store.namespace, self.store.name,
                     self.identity)
        return True

    async def acquire(self) -> None:
        """Return once this candidate holds the Lease."""
        announced = False
        while True:
            try:
                if await self._try():
                    self.is_leader = True
                    return
            except Exception as exc:  # API hiccup: keep trying
                log.warning("lease read/write failed: %s", exc)
            if not announced:
                log.info("waiting for lease %s/%s (held by another replica)",
                         self.store.namespace, self.store.name)
                announced = True
            await asyncio.sleep(self.retry_period_s)

    async def hold(self) -> None:
        """Renew until a renewal cannot succeed within renew_deadline; then return."""
        last_ok = time.monotonic()
        while True:
            await asyncio.sleep(self.retry_period_s)
            try:
                if await self._try():
                    last_ok = time.monotonic()
                    continue
            except Exception as exc:
                log.warning("lease renewal failed: %s", exc)
            if time.monotonic() - last_ok >= self.renew_deadline_s:
                self.is_leader = False
                log.error("lost lease %s/%s: could not renew within %.0fs",
                          self.store.namespace, self.store.name, self.renew_deadline_s)
                return

    def release(self) -> None:
        """Give the Lease up at shutdown so a standby takes over at once."""
        if not self.is_leader:
            return
        self.is_leader = False
        try:
            record, rv = self.store.read()
            if record is not None and record.holder == self.identity:
                self.store.write(LeaseRecord(None, record.renew_time, 1, record.transitions,
                                             None), rv)
                log.info("released lease %s/%s", self.store.namespace, self.store.name)
        except Exception as exc:
            log.warning("could not release lease: %s", exc)
