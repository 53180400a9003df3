"""The one way an engine server drains, whoever asks (SIGTERM or POST /admin/drain).

A drain turns readiness false (so the Service and the router stop sending:
/ready answers 503, new generation requests get 503 `shutting_down`), lets
every admitted request finish, and after `timeout_s` aborts what is left
(those end with finish_reason "abort"). It does not stop the process: on
SIGTERM the runtime shuts uvicorn down once the drain is over; after an admin
drain the pod keeps answering /metrics and /admin/drain until the operator
removes it (whose SIGTERM then finds nothing left to wait for).

Invariant: at most one drain per server; asking again joins the running one. An admin drain
can be cancelled (DELETE /admin/drain: the operator scaled the pool up again), which makes the
server ready again; a shutdown's drain (SIGTERM) cannot.

An admin drain may carry a lease (`lease_s`): whoever asked renews it by asking again, and a
lease that runs out cancels the drain. The operator drains with a lease, so an engine whose
operator died mid-drain (and whose next leader did not take the drain over) serves again by
itself instead of staying unready, and unremoved, forever.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from kvmesh.engine.server.async_engine import AsyncEngine

log = logging.getLogger("kvmesh.server")

MAX_DRAIN_LEASE_S = 86400.0
ABORT_GRACE_S = 5.0  # after aborting leftovers at the timeout, time for their final chunks


@dataclass
class Drainer:
    aengine: AsyncEngine
    timeout_s: float = 30.0
    abort_grace_s: float = ABORT_GRACE_S
    reason: str | None = None
    started_at: float | None = None  # Unix time
    finished_at: float | None = None
    aborted: int = 0  # requests still in flight at the timeout
    final: bool = False  # a shutdown waits for this drain: it cannot be cancelled
    lease_expires_at: float | None = None  # Unix time; None: the drain holds until cancelled
    _task: asyncio.Task | None = field(default=None, repr=False)
    _lease_task: asyncio.Task | None = field(default=None, repr=False)

    @property
    def started(self) -> bool:
        return self._task is not None

    @property
    def done(self) -> bool:
        return self._task is not None and self._task.done()

    def start(self, why: str, final: bool = False, lease_s: float | None = None) -> asyncio.Task:
        """Begin draining (call on the event loop); returns the drain's task, the same on every
        call. ``final``: the process shuts down after it (SIGTERM), so nothing may cancel it.
        ``lease_s``: the drain is cancelled unless asked for again within that many seconds
        (each call renews it; a call without one makes the drain hold until cancelled)."""
        self.final = self.final or final
        if self._task is None:
            self.reason = why
            self.started_at = time.time()
            self._task = asyncio.ensure_future(self._run(why))
        if self.final or lease_s is None:
            self.lease_expires_at = None
        else:
            self.lease_expires_at = time.time() + lease_s
            if self._lease_task is None:
                self._lease_task = asyncio.ensure_future(self._expire())
        return self._task

    async def _expire(self) -> None:
        # Sleeps until the current expiry; a renewal moves it, so look again after each sleep.
        while self.lease_expires_at is not None and not self.final:
            left = self.lease_expires_at - time.time()
            if left <= 0:
                log.warning("drain lease (%s) ran out without a renewal: serving again", self.reason)
                self._lease_task = None  # cancel() must not cancel this task, which runs it
                self.cancel()
                return
            await asyncio.sleep(left)
        self._lease_task = None

    async def _run(self, why: str) -> None:
        ae = self.aengine
        log.info("%s: draining (%d request(s) in flight, timeout %.0fs)", why,
                 ae.num_active_requests, self.timeout_s)
        ae.begin_drain()
        if not await ae.wait_idle(self.timeout_s):
            self.aborted = ae.num_active_requests
            log.warning("drain timeout: aborting %d request(s)", self.aborted)
            ae.abort_all()
            await ae.wait_idle(self.abort_grace_s)
        self.finished_at = time.time()
        log.info("drained (%s)", why)

    def cancel(self) -> bool:
        """Stop an admin drain and take requests again; False when it is a shutdown's (``final``).
        Requests aborted at a passed timeout stay aborted; nothing else is lost."""
        if self.final:
            return False
        if self._task is not None:
            self._task.cancel()
            log.info("drain cancelled (%s): taking requests again", self.reason)
        if self._lease_task is not None:
            self._lease_task.cancel()
        self._task = self._lease_task = None
        self.reason = self.started_at = self.finished_at = self.lease_expires_at = None
        self.aborted = 0
        self.aengine.end_drain()
        return True

    def status(self) -> dict[str, Any]:
        """What GET /admin/drain answers; `in_flight` counts API requests still running."""
        return {
            "draining": self.started,
            "done": self.done,
            "in_flight": self.aengine.num_active_requests,
            "queued": self.aengine.num_queued,
            "state": self.aengine.state.value,
            "reason": self.reason,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "timeout_s": self.timeout_s,
            "aborted": self.aborted,
            "lease_expires_at": self.lease_expires_at,
        }
