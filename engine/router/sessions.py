"""Session bindings for the `session` policy: session key -> endpoint, with idle expiry.

Invariants: a binding older than ``idle_s`` since its last use is never returned; the table
holds at most ``max_sessions`` bindings (the least recently used go first), so a client that
invents a new session id per request cannot grow the router without bound.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

SESSION_HEADER = "x-session-id"


def session_key(headers: Mapping[str, str], user: object) -> str | None:
    """The request's session: the ``x-session-id`` header, else the body's ``user`` field."""
    key = headers.get(SESSION_HEADER)
    if key:
        return key
    return user if isinstance(user, str) and user else None


@dataclass
class SessionTable:
    idle_s: float = 600.0
    max_sessions: int = 100_000
    _bindings: OrderedDict[str, tuple[str, float]] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if self.idle_s <= 0:
            raise ValueError(f"session idle expiry must be > 0 seconds, got {self.idle_s}")
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {self.max_sessions}")

    def __len__(self) -> int:
        return len(self._bindings)

    def target(self, key: str, now: float) -> str | None:
        """The endpoint ``key`` is bound to, or None when unbound or idle too long."""
        hit = self._bindings.get(key)
        if hit is None:
            return None
        endpoint, last = hit
        if now - last > self.idle_s:
            del self._bindings[key]
            return None
        return endpoint

    def bind(self, key: str, endpoint: str, now: float) -> None:
        """Bind (or rebind) ``key`` to ``endpoint`` and mark it used at ``now``."""
        self._bindings[key] = (endpoint, now)
        self._bindings.move_to_end(key)
        while len(self._bindings) > self.max_sessions:
            self._bindings.popitem(last=False)

    def expire(self, now: float) -> int:
        """Drop every binding idle longer than ``idle_s``; returns how many were dropped."""
        dropped = 0
        # Bindings are in last-use order, so the idle ones are all at the front.
        while self._bindings:
            key, (_, last) = next(iter(self._bindings.items()))
            if now - last <= self.idle_s:
                break
            del self._bindings[key]
            dropped += 1
        return dropped

    def forget_endpoint(self, endpoint: str) -> None:
        """Drop bindings to an endpoint that left the pool."""
        for key in [k for k, (e, _) in self._bindings.items() if e == endpoint]:
            del self._bindings[key]
