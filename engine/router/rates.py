"""Each engine's measured speed, as the router sees it: prefill seconds per token and decode
seconds per running sequence. The load scorer (engine/router/policies.py) turns queued prefill
and running decode into seconds with them, so an engine slowed by a big decode batch looks as
slow as it is.

Two sources, neither of which costs the request path more than a few float operations per
request (never per token):

- **Prefill** (``PrefillClock``): the router's own in-flight accounting. While an engine has
  uncached prompt tokens queued by this router it is busy prefilling them; each first byte
  drains that request's tokens. Tokens drained over busy time is the rate the engine's queue
  actually empties at, decode interference included (a mixed step carries both). Concurrent
  requests need no special case: the busy time between two first bytes is charged to the
  tokens of the second, so over a busy period the ratio is total tokens / total busy time.
- **Decode** (``decode_seconds_per_seq``): the engine's ``kvmesh_inter_token_latency_seconds``
  histogram, read by the probe that already scrapes ``/metrics``: the median step time over the
  last probe interval (``interval_median`` of the bucket counts' increase) divided by the running
  batch it served. The median, not the mean: a step that carried a long prefill stalls every
  running sequence's next token, and that prefill is already counted as queued prefill.

Estimates decay (``RateEstimate.observe``), so they follow an engine whose load changes, and
stay ``None`` until enough has been seen (then the scorer uses its prior).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

PREFILL_DECAY = 0.95
"""Weight kept by past prefill observations per new one (about the last 20 requests count: one
request's drain time is noisy, since it shares steps with whatever else the engine runs)."""
MIN_PREFILL_TOKENS = 256.0
"""Decayed tokens an estimate needs before it replaces the prior."""


@dataclass(frozen=True)
class RateEstimate:
    """Decayed sums of units of work and of the seconds they took.

    Invariant: ``units >= 0`` and ``seconds >= 0``; ``seconds_per_unit`` is their ratio once
    ``units`` reaches the minimum, else None.
    """

    units: float = 0.0
    seconds: float = 0.0

    def observe(self, units: float, seconds: float, decay: float = PREFILL_DECAY) -> RateEstimate:
        """The estimate with one more observation; negative inputs count as 0."""
        return RateEstimate(decay * self.units + max(0.0, units), decay * self.seconds + max(0.0, seconds))

    def seconds_per_unit(self, min_units: float = MIN_PREFILL_TOKENS) -> float | None:
        if self.units < min_units or self.units <= 0 or self.seconds <= 0:
            return None
        return self.seconds / self.units


@dataclass
class PrefillClock:
    """Busy-time accounting of one engine's queued prefill (mutated on the event loop only).

    ``busy_since`` is when the current charge started: the moment the router's queued prefill
    tokens for the engine went from 0 to more, or the last first byte while tokens stayed
    queued; None while nothing is queued. Invariant: ``busy_since is None`` iff the caller's
    queued token count for the engine is 0 (the dispatcher keeps it so, see ``queued``/``drained``).
    """

    estimate: RateEstimate = RateEstimate()
    busy_since: float | None = None

    def queued(self, tokens_before: int, now: float) -> None:
        """A request was queued while ``tokens_before`` tokens already were."""
        if tokens_before <= 0:
            self.busy_since = now

    def drained(self, tokens: int, tokens_left: int, now: float, measured: bool = True) -> None:
        """A request's ``tokens`` left the queue (its first byte when ``measured``, else a failure
        or an abort, which is not timed); ``tokens_left`` are still queued after it."""
        if measured and self.busy_since is not None and tokens > 0:
            self.estimate = self.estimate.observe(tokens, now - self.busy_since)
            self.busy_since = now
        if tokens_left <= 0:
            self.busy_since = None

    def seconds_per_token(self) -> float | None:
        return self.estimate.seconds_per_unit()


def interval_median(before: Sequence[tuple[float, float]] | None,
                    after: Sequence[tuple[float, float]]) -> float | None:
    """The median of what a cumulative histogram observed between two scrapes.

    ``before``/``after``: (upper bound ``le``, cumulative count) per bucket, ascending, ``+Inf``
    last, as exposed. Linear inside the bucket that holds the median (from 0 for the first);
    None when nothing was observed, the buckets differ, or a count went back (a restart).
    """
    if before is None or len(before) != len(after) or not after:
        return None
    deltas = []
    for (le0, c0), (le1, c1) in zip(before, after):
        if le0 != le1 or c1 < c0:
            return None
        deltas.append((le1, c1 - c0))
    total = deltas[-1][1]
    if total <= 0:
        return None
    half, lower, below = total / 2.0, 0.0, 0.0
    for le, cum in deltas:
        if cum >= half:
            if le == float("inf"):
                return lower  # past the last finite bound: that bound is all we know
            inside = cum - below
            return lower + (le - lower) * ((half - below) / inside if inside > 0 else 1.0)
        lower, below = le, cum
    return None


def decode_seconds_per_seq(step_s: float | None, running: int | None) -> float | None:
    """A decode step time shared by the running batch that took it (a batch of at least one)."""
    if step_s is None or step_s < 0:
        return None
    return step_s / max(1, running or 0)
