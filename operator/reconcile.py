"""One reconciliation pass per InferenceDeployment, and the coalescing that
keeps bursts of watch events from queueing up passes.

A pass is level-based: read the CR, render every child, server-side apply all
of them (a no-op for children already as rendered), read the Deployments
back, write the status if it changed. It needs no memory of earlier passes,
so any trigger (the CR changed, a child changed or vanished, the periodic
resync) simply asks for a pass.
"""

from __future__ import annotations

import logging
import secrets
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Mapping

from . import spec as s
from .gateway import ObjectRef, stale_refs
from .render import Owner, render_all, render_auth_secret
from .status import compute_status, status_changed

log = logging.getLogger("kvmesh.operator")


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class ReconcileError(RuntimeError):
    """A pass that could not bring the children to the rendered state."""


@dataclass
class KubeOps:
    """The API operations a pass needs (kube.py in production, fakes in tests)."""

    get: Callable[[str, str], Mapping[str, Any] | None]
    apply: Callable[[Mapping[str, Any]], None]
    deployments: Callable[[str, str, str], Mapping[str, Mapping[str, Any]]]
    patch_status: Callable[[str, str, Mapping[str, Any]], None]
    # Create an object only if it does not exist yet (the auth Secret: its token must never be replaced).
    create_if_absent: Callable[[Mapping[str, Any]], None]
    apply_error: type[Exception] = RuntimeError
    # (ns, name) -> the owner's pods by component, for crash-loop detection; None: not read.
    pods: Callable[[str, str], Mapping[str, list[Mapping[str, Any]]]] | None = None
    # Delete an optional child the spec no longer asks for, if the given owner uid controls it.
    delete_owned: Callable[[ObjectRef, str], None] | None = None


@dataclass
class _KeyState:
    running: bool = False
    dirty: bool = False


@dataclass
class Reconciler:
    ops: KubeOps
    now: Callable[[], str] = utc_now
    _guard: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _keys: dict[tuple[str, str], _KeyState] = field(default_factory=dict, repr=False)

    def reconcile(self, namespace: str, name: str) -> dict[str, Any] | None:
        """One pass; returns the status written (or unchanged), None if the CR is gone."""
        obj = self.ops.get(namespace, name)
        if obj is None or obj.get("metadata", {}).get("deletionTimestamp"):
            return None  # the garbage collector removes the children
        error: str | None = None
        reason = "ApplyFailed"
        try:
            manifests = render_all(obj)
        except s.SpecError as exc:
            manifests, error, reason = [], str(exc), "InvalidSpec"
        failures = []
        if manifests:
            try:
                self.ops.create_if_absent(render_auth_secret(Owner.from_object(obj), secrets.token_urlsafe(32)))
            except self.ops.apply_error as exc:
                failures.append(str(exc))
        for manifest in manifests:
            try:
                self.ops.apply(manifest)
            except self.ops.apply_error as exc:
                failures.append(str(exc))
        if manifests and self.ops.delete_owned is not None:
            owner = Owner.from_object(obj)
            for ref in stale_refs(s.parse_spec(obj.get("spec") or {}), owner):
                try:
                    self.ops.delete_owned(ref, owner.uid)
                except self.ops.apply_error as exc:
                    failures.append(str(exc))
        if failures:
            error = "; ".join(failures)
        owner = Owner.from_object(obj)
        children = self.ops.deployments(namespace, name, owner.uid)
        pods = self.ops.pods(namespace, name) if self.ops.pods else None
        status = compute_status(obj, children, self.now(), error, reason, pods)
        if status_changed(obj.get("status"), status):
            self.ops.patch_status(namespace, name, status)
        if error:
            raise ReconcileError(f"{namespace}/{name}: {error}")
        return status

    def request(self, namespace: str, name: str) -> bool:
        """Run passes for one CR until no new request arrived during the last.

        A request made while a pass for the same CR is running only marks it
        dirty, and the running caller does one more pass: N events in a
        burst cost at most two passes, never N. Returns False when the request
        was folded into a running pass.
        """
        key = (namespace, name)
        with self._guard:
            state = self._keys.setdefault(key, _KeyState())
            if state.running:
                state.dirty = True
                return False
            state.running = True
        try:
            while True:
                with self._guard:
                    state.dirty = False
                self.reconcile(namespace, name)
                with self._guard:
                    if not state.dirty:
                        return True
        finally:
            with self._guard:
                state.running = False
                if not state.dirty:
                    self._keys.pop(key, None)

    def resync(self, objects: list[Mapping[str, Any]]) -> int:
        """Reconcile every listed CR; errors are logged, not raised. Returns failures."""
        failed = 0
        for obj in objects:
            meta = obj.get("metadata", {})
            try:
                self.request(meta["namespace"], meta["name"])
            except Exception as exc:  # keep resyncing the others
                failed += 1
                log.warning("resync of %s/%s failed: %s", meta.get("namespace"),
                            meta.get("name"), exc)
        return failed
