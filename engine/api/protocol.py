"""Request bodies of the OpenAI completions and chat completions APIs.

Only the shape of a request is checked here (types, presence, simple ranges);
what depends on the model or the engine (context length, defaults, parameters
we do not implement) is decided in `params.py`. Unknown fields are ignored, as
clients add new optional fields faster than servers learn them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_N = 128  # choices per request; each is one engine sequence
MAX_STOP_STRINGS = 16
MAX_BAD_WORDS, MAX_BAD_WORD_CHARS = 100, 100  # vLLM's bad_words (SamplingParams.MAX_BAD_WORDS)
INT64_MIN, UINT64_MAX = -(2**63), 2**64 - 1


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class KVTransferParams(BaseModel):
    """The router's instructions for a prefill/decode handoff (docs/disagg.md).

    To a prefill engine: ``transfer_id``, ``decode_host`` and ``decode_port``; to a decode engine:
    ``transfer_id`` only.
    """

    model_config = ConfigDict(extra="forbid")

    transfer_id: str = Field(min_length=1, max_length=128)
    decode_host: str | None = Field(None, min_length=1, max_length=253)
    decode_port: int | None = Field(None, gt=0, lt=65536)


class _SamplingFields(BaseModel):
    """Fields the two APIs share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=UINT64_MAX)
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extensions that vLLM-style clients and load tools send.
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    repetition_penalty: float | None = None
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    priority: int = 0
    # Structured outputs, vLLM's extensions (docs/server.md): at most one constraint per request.
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    """vLLM's tenant isolation field: requests share cached prefixes only with the same salt."""
    # Prefill/decode disaggregation (docs/disagg.md): set by the router, never by clients.
    kv_transfer_params: KVTransferParams | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(v)}")
        return v

    @field_validator("bad_words")
    @classmethod
    def _bad_words(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and len(v) > MAX_BAD_WORDS:
            raise ValueError(f"at most {MAX_BAD_WORDS} bad words are allowed, got {len(v)}")
        for w in v or ():
            if not w.strip() or len(w) > MAX_BAD_WORD_CHARS:
                raise ValueError(f"bad words must be strings of 1 to {MAX_BAD_WORD_CHARS} characters, "
                                 f"not only whitespace; got {w[:40]!r}")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `prompt` is a string, a list of strings, token ids or lists of token ids."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list, each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    """An assistant turn's earlier calls (api/tools.py renders them into the prompt)."""
    tool_call_id: str | None = None


class JSONSchemaFormat(BaseModel):
    """``response_format.json_schema``: the schema is under ``schema`` (a BaseModel attribute name,
    hence the alias)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str = "text"
    json_schema: JSONSchemaFormat | None = None


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
