"""Prefill pacing against a TPOT target: how many prompt tokens a step that carries decodes may add.

A step is as long as its decodes plus its prefill chunk (bench/step_profile.py --interference: a
mixed step costs what its parts cost alone), and every stream decoding in it waits for the whole
step. With ``tpot_slo_s`` set, a step's prefill tokens are cut to what fits in the smallest
slack of the streams it carries: stream r, with k output tokens of which the first came at
``first``, keeps its mean time per output token within the target after this step while

    now + step - first <= tpot_slo_s * k,

so the step may last ``min_r(tpot_slo_s * k_r - (now - first_r))``. Less the decode-only step time,
that leaves room for ``room / prefill_s_per_token`` prompt tokens. Streams that ran faster than
the target bank the difference, so a long prompt still advances, in larger chunks the more slack
its neighbours have. A stream whose slack is already below a decode-only step would miss the
target even if no prompt ran beside it: it no longer constrains anyone (holding prompts back for
it would cost their first tokens and buy nothing). At least ``min_tokens`` are granted whenever
any prefill is scheduled, so a prompt always progresses.

Both rates are learned from the engine's own steps (exponential moving averages): a decode-only
step's seconds, and a mixed or prefill step's seconds beyond that, per prompt token. Until a
per-token rate is measured nothing is cut; until a decode-only step is seen the decode part counts
as zero in both (a mixed step's whole time is charged to its prompt tokens: smaller chunks, never
larger ones).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


@dataclass
class PrefillPacer:
    """Per-engine state: the target and the two measured rates. ``budget`` is a pure function of
    them and the streams; ``observe`` is the only mutation (once per executed step)."""

    tpot_slo_s: float
    min_tokens: int = 16
    alpha: float = 0.25
    decode_step_s: float | None = None
    prefill_s_per_token: float | None = None

    def __post_init__(self) -> None:
        if not self.tpot_slo_s > 0:
            raise ValueError(f"tpot_slo_s must be > 0, got {self.tpot_slo_s}")
        if self.min_tokens < 1:
            raise ValueError(f"min_tokens must be >= 1, got {self.min_tokens}")

    def observe(self, num_decodes: int, prefill_tokens: int, seconds: float) -> None:
        """Learn from one executed step: ``num_decodes`` one-token sequences and
        ``prefill_tokens`` prompt tokens took ``seconds``."""
        if seconds <= 0:
            return
        if prefill_tokens == 0:
            if num_decodes > 0:
                self.decode_step_s = _ewma(self.decode_step_s, seconds, self.alpha)
            return
        base = self.decode_step_s if num_decodes > 0 and self.decode_step_s is not None else 0.0
        per_token = (seconds - base) / prefill_tokens
        if per_token > 0:
            self.prefill_s_per_token = _ewma(self.prefill_s_per_token, per_token, self.alpha)

    def budget(self, now: float, streams: Iterable[tuple[float, int]]) -> int | None:
        """Prompt tokens this step may compute beside the decoding ``streams``, each given as
        (first token time, output tokens so far); None: no limit (no stream, or not measured)."""
        if self.prefill_s_per_token is None:
            return None
        decode_s = self.decode_step_s or 0.0
        slacks = [self.tpot_slo_s * k - (now - first) for first, k in streams]
        room = min((sl - decode_s for sl in slacks if sl >= decode_s), default=None)
        if room is None:  # no stream, or none that can still make the target
            return None
        return max(self.min_tokens, int(room / self.prefill_s_per_token))


def _ewma(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else (1 - alpha) * old + alpha * new
