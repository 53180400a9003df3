"""What the engine reports back for each request after a step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TokenLogprob:
    """Log-probability of one generated token and its top alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.monotonic()) of a request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """The delta a step produced for one request, plus its running totals.

    `new_token_ids`, `text_delta` and `logprobs` hold only what this step added;
    `num_output_tokens` counts the tokens generated so far. `output_token_ids` and
    `text` (the totals) are filled in the final output only: copying them on every
    step would make a long stream quadratic. When `finished` is True
    this is the request's last output and `finish_reason` is one of
    "stop" (EOS, stop token or stop string), "length" (max_tokens or the model
    length), "abort", "error" (the step failed for this request; `error` says why),
    or "transfer" (prefill role: the first token and the KV went to a decode engine; `handoff`).
    """

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    output_token_ids: list[int]
    text_delta: str
    text: str
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    logprobs: list[TokenLogprob] | None
    metrics: RequestMetrics
    stop_reason: int | str | None = None  # the stop token id or string that ended it
    num_output_tokens: int = -1  # -1: take len(output_token_ids)
    error: str | None = None  # set only with finish_reason "error"
    handoff: Any = None  # prefill role: the KVHandoff of a request that finished with "transfer"
    prompt_logprobs: list[TokenLogprob] | None = None
    """With ``SamplingParams.prompt_logprobs``, on the output of the first token only: prompt
    tokens 1..n-1 (the first has none)."""

    def __post_init__(self) -> None:
        if self.num_output_tokens < 0:
            self.num_output_tokens = len(self.output_token_ids)
