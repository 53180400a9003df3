"""How many KV event records the replay socket may send, per subscriber and in all.

A replay answer is a burst of messages from a thread that shares the GIL with the engine's
step thread, and a subscriber that keeps asking (or never reads) could make it one burst after
another. The budget caps each answer and meters records per second with token buckets: one per
subscriber connection and one for the whole publisher (a client that reconnects for a fresh
identity still meets the global bucket). A refused or capped answer is safe: the subscriber sees
that it did not reach the seq it needed and resyncs from the HTTP snapshot.

Pure bookkeeping: the caller passes the clock, so tests decide time.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ReplayLimits:
    max_records: int = 2_000
    """Records in one answer at most (the rest comes from the snapshot)."""
    client_rate: float = 20_000.0
    """Records per second one subscriber connection may be sent, sustained; its burst is ``max_records``."""
    total_rate: float = 100_000.0
    """Records per second for every subscriber together; the burst is ``5 * max_records``."""
    clients: int = 1_024
    """Subscriber buckets remembered (least recently seen forgotten first: memory stays bounded)."""

    def __post_init__(self) -> None:
        if self.max_records < 1 or self.client_rate <= 0 or self.total_rate <= 0 or self.clients < 1:
            raise ValueError(f"replay limits must be positive, got {self}")


@dataclass
class _Bucket:
    tokens: float
    at: float

    def refill(self, now: float, rate: float, burst: float) -> None:
        self.tokens = min(burst, self.tokens + max(0.0, now - self.at) * rate)
        self.at = now


@dataclass
class ReplayBudget:
    """Grants record counts to replay answers. Invariant: over any window of T seconds a client is
    granted at most ``max_records + client_rate * T`` records, and all clients together at most
    ``5 * max_records + total_rate * T``."""

    limits: ReplayLimits = field(default_factory=ReplayLimits)
    _clients: OrderedDict[bytes, _Bucket] = field(default_factory=OrderedDict)
    _total: _Bucket | None = None

    def grant(self, client: bytes, wanted: int, now: float) -> int:
        """Records (0..``wanted``) the answer to ``client`` may carry now; they are spent at once."""
        lim = self.limits
        total_burst = 5.0 * lim.max_records
        if self._total is None:
            self._total = _Bucket(total_burst, now)
        self._total.refill(now, lim.total_rate, total_burst)
        bucket = self._clients.pop(client, None) or _Bucket(float(lim.max_records), now)
        bucket.refill(now, lim.client_rate, lim.max_records)
        self._clients[client] = bucket
        while len(self._clients) > lim.clients:
            self._clients.popitem(last=False)
        n = max(0, min(wanted, lim.max_records, int(bucket.tokens), int(self._total.tokens)))
        bucket.tokens -= n
        self._total.tokens -= n
        return n
