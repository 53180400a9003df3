"""Admission by the time per output token: new requests wait while the running streams are slow.

Every stream in a step waits for the whole step, so the seconds of the steps that carry decodes
are what a stream gets as its time per output token. An engine that shares prefixes fits more
streams in its KV pool than it can step within a TPOT target on a slow core; past that point each
admission makes every running stream miss the target. With a target, ``TpotGate`` keeps a moving
average of those steps' seconds (the engine's own: from one step's start to the next's, so the
scheduling, sampling and output work count as the streams see them) and admits:

- the head of the queue whenever nothing runs (an idle engine never waits on the gate);
- otherwise at most one new request per step, and none while the average is at or above the
  target: a burst of admissions would put its prompts into the steps of every running stream at
  once, and one request per step is still several times the arrival rate a stepping engine can
  serve.

Requests held back stay in the queue, in order; a TTFT target (scheduler) then decides which of
them still go first. The gate never preempts and never refuses a request: it only defers.
"""

from __future__ import annotations

from dataclasses import dataclass

TARGET_FRACTION = 0.75
"""The gate's level as a fraction of a TPOT target where only the target is given (the operator's
``spec.slo.admission: TPOTGated``, bench/fleet.py's ``-gated``): of 60%, 75%, 85% and 90% of a
100 ms target, 75% met the most requests on the saturating fleet trace (docs/benchmarks.md)."""


@dataclass
class TpotGate:
    """Per-engine state: the target and the moving average of steps that carried decodes.

    ``observe`` is the only mutation (once per executed step); ``admits`` is pure."""

    target_s: float
    alpha: float = 0.25
    step_s: float | None = None

    def __post_init__(self) -> None:
        if not self.target_s > 0:
            raise ValueError(f"target_s must be > 0, got {self.target_s}")
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")

    def observe(self, num_decodes: int, seconds: float) -> None:
        """Learn from one executed step that carried ``num_decodes`` one-token sequences."""
        if num_decodes > 0 and seconds > 0:
            self.step_s = seconds if self.step_s is None else (1 - self.alpha) * self.step_s + self.alpha * seconds

    def admits(self, num_running: int, admitted_this_step: int) -> bool:
        """Whether the scheduler may admit one more request into this step."""
        if num_running == 0:
            return True
        if admitted_this_step >= 1:
            return False
        return self.step_s is None or self.step_s < self.target_s
