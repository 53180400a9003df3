"""Per-request sampling parameters."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.engine.structured.grammar import StructuredOutput


class InvalidSamplingParams(ValueError):
    """A sampling parameter has the wrong type or is out of range; the message starts with its name."""


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    """An int or float that is not a bool and not NaN (NaN compares false to every bound)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature == 0 means greedy; any positive temperature, however small, samples
    (numerically safely: a tiny one picks the argmax). top_k == -1, top_p == 1 and
    min_p == 0 disable those filters. `logprobs` is None for none, else the number of top
    alternatives to return beside the sampled token (0 = the sampled token only).
    A request with a `seed` samples the same tokens whatever else is batched with it.

    Logit controls (engine/logits_processing.py) act on the raw logits before temperature:
    `presence_penalty` and `frequency_penalty` (OpenAI's, over the generated tokens),
    `repetition_penalty` (over prompt and generated tokens; 1 is off), `logit_bias` (token id ->
    added bias), `min_tokens` (EOS and `stop_token_ids` are masked, and stop strings are not
    checked, until that many tokens were generated), `allowed_token_ids` (every other token is
    masked) and `bad_words_token_ids` (vLLM's `bad_words`, tokenized: the last token of each
    sequence is masked when the generated tokens end with the rest of it; a one-token sequence is
    always masked). Token ids are checked against the vocabulary by the engine, not here.
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    prompt_logprobs: int | None = None
    """None for none, else the logprob of every prompt token after the first with this many top
    alternatives (0 = the prompt token only); such a request skips prefix-cache hits (a cached
    position has no logits)."""
    structured: StructuredOutput | None = None
    """A grammar the output must match (engine/structured): valid by construction, ending with
    "stop" when the grammar is complete."""

    MAX_LOGPROBS = 20
    MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
    MAX_BAD_WORDS = 100  # words of the API's bad_words; each gives one or two token sequences
    MAX_BAD_WORD_TOKENS = 32

    def validate(self) -> "SamplingParams":
        """Check types and ranges; raise InvalidSamplingParams naming the first bad field.

        Types are checked strictly (a bool is not an int, a float is not an int) so that
        nothing which would fail later inside the engine step gets past the door.
        """
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidSamplingParams(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not 0.0 <= self.temperature <= 2.0:
            raise InvalidSamplingParams(f"temperature must be a number in [0, 2], got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidSamplingParams(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1):
            raise InvalidSamplingParams(f"top_k must be -1 (off) or a positive integer, got {self.top_k!r}")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidSamplingParams(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise InvalidSamplingParams(f"seed must be an integer or None, got {self.seed!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= self.MAX_LOGPROBS):
            raise InvalidSamplingParams(
                f"logprobs must be None or an integer between 0 and {self.MAX_LOGPROBS}, got {self.logprobs!r}"
            )
        if not isinstance(self.stop, (list, tuple)) or any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidSamplingParams("stop must be a list of non-empty strings")
        if not isinstance(self.stop_token_ids, (list, tuple)) or any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise InvalidSamplingParams("stop_token_ids must be a list of non-negative integers")
        self._validate_logit_controls()
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS):
            raise InvalidSamplingParams(f"prompt_logprobs must be None or an integer between 0 and "
                                        f"{self.MAX_LOGPROBS}, got {self.prompt_logprobs!r}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise InvalidSamplingParams(f"structured must be a StructuredOutput, got {type(self.structured).__name__}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidSamplingParams(f"{name} must be true or false, got {getattr(self, name)!r}")
        return self

    def _validate_logit_controls(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not -2.0 <= v <= 2.0:
                raise InvalidSamplingParams(f"{name} must be a number in [-2, 2], got {v!r}")
        rp = self.repetition_penalty
        if not _is_real(rp) or not 0.0 < rp <= 2.0:
            raise InvalidSamplingParams(f"repetition_penalty must be a number in (0, 2] (1 is off), got {rp!r}")
        bias = self.logit_bias
        if not isinstance(bias, dict) or len(bias) > self.MAX_LOGIT_BIAS:
            raise InvalidSamplingParams(f"logit_bias must map at most {self.MAX_LOGIT_BIAS} token ids to biases")
        for tok, b in bias.items():
            if not _is_int(tok) or tok < 0:
                raise InvalidSamplingParams(f"logit_bias keys must be non-negative token ids, got {tok!r}")
            if not _is_real(b) or not -100.0 <= b <= 100.0:
                raise InvalidSamplingParams(f"logit_bias values must be numbers in [-100, 100], got {b!r} for token {tok}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidSamplingParams(
                f"min_tokens must be an integer between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens!r}")
        allowed = self.allowed_token_ids
        if allowed is not None and (not isinstance(allowed, (list, tuple)) or not allowed
                                    or any(not _is_int(t) or t < 0 for t in allowed)):
            raise InvalidSamplingParams("allowed_token_ids must be a non-empty list of non-negative token ids")
        bad = self.bad_words_token_ids
        if (not isinstance(bad, (list, tuple)) or len(bad) > 2 * self.MAX_BAD_WORDS
                or any(not isinstance(w, (list, tuple)) or not 0 < len(w) <= self.MAX_BAD_WORD_TOKENS
                       or any(not _is_int(t) or t < 0 for t in w) for w in bad)):
            raise InvalidSamplingParams(
                f"bad_words_token_ids must be at most {2 * self.MAX_BAD_WORDS} lists of 1 to "
                f"{self.MAX_BAD_WORD_TOKENS} non-negative token ids")

    def token_ids_named(self) -> list[int]:
        """Every token id the parameters name (for the engine's vocabulary check)."""
        return [*self.stop_token_ids, *self.logit_bias, *(self.allowed_token_ids or ()),
                *(t for w in self.bad_words_token_ids for t in w)]

    @property
    def controls_logits(self) -> bool:
        """True when any logit control is on (the sampler then runs logits_processing first)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.allowed_token_ids is not None
                    or bool(self.bad_words_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
