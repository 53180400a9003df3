"""Per-request sampling parameters."""

from __future__ import annotations

from dataclasses import dataclass, field


class InvalidSamplingParams(ValueError):
    """A sampling parameter is out of range; the message names it."""


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature == 0 means greedy. top_k <= 0 and top_p == 1 and min_p == 0
    disable those filters. `logprobs` is None for none, else the number of top
    alternatives to return beside the sampled token (0 = the sampled token only).
    A request with a `seed` samples the same tokens whatever else is batched with it.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False

    MAX_LOGPROBS = 20

    def validate(self) -> "SamplingParams":
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidSamplingParams(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 2.0:
            raise InvalidSamplingParams(f"temperature must be in [0, 2], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidSamplingParams(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k < -1):
            raise InvalidSamplingParams(f"top_k must be -1 (off) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidSamplingParams(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= self.MAX_LOGPROBS:
            raise InvalidSamplingParams(
                f"logprobs must be between 0 and {self.MAX_LOGPROBS}, got {self.logprobs!r}"
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidSamplingParams("stop strings must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidSamplingParams("stop_token_ids must be non-negative integers")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
