"""``POST /tokenize`` and ``POST /detokenize`` as vLLM serves them: pure functions over the
engine's ``Tokenizer``, shared by the engine's server and the router.

A completions prompt is tokenized exactly as ``/v1/completions`` runs it (no special tokens added
unless ``add_special_tokens`` asks), and chat messages exactly as ``/v1/chat/completions`` renders
them (``params.chat_prompt_ids``), so ``count`` is the number of prompt tokens the request would
be billed and limited by.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvmesh.engine.api import errors, params
from kvmesh.engine.api.protocol import ChatCompletionRequest, ChatMessage

if TYPE_CHECKING:
    from kvmesh.engine.model.tokenizer import Tokenizer

TOKENIZE, DETOKENIZE = "/tokenize", "/detokenize"
MAX_DETOKENIZE_TOKENS = 1 << 20


class TokenizeRequest(BaseModel):
    """Either ``prompt`` (a completions prompt) or ``messages`` (a chat), never both."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[dict[str, Any]] | None = None
    """With ``messages``: rendered into the prompt as chat renders them."""
    add_special_tokens: bool = False
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of 'prompt' and 'messages'")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int] = Field(max_length=MAX_DETOKENIZE_TOKENS)


def tokenize(tokenizer: Tokenizer, req: TokenizeRequest, max_model_len: int | None) -> dict[str, Any]:
    """The body of a /tokenize answer; a 400 naming the field for text the model cannot take."""
    if req.messages is not None:
        chat = ChatCompletionRequest(messages=req.messages, tools=req.tools)
        params.check_chat_unsupported(chat)
        ids = params.chat_prompt_ids(tokenizer, chat, add_generation_prompt=req.add_generation_prompt)
    else:
        assert req.prompt is not None
        ids = tokenizer.encode(params.check_text(req.prompt, "prompt"), add_special_tokens=req.add_special_tokens)
    strs = tokenizer.hf.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(tokenizer: Tokenizer, req: DetokenizeRequest) -> dict[str, Any]:
    """The body of a /detokenize answer: the exact text of ``tokens``, special tokens included
    (so detokenize inverts tokenize); a 400 for an id outside the vocabulary."""
    vocab = tokenizer.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise errors.invalid_request(f"token ids must be in [0, {vocab}), got {bad}", "tokens")
    return {"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)}


def answer(path: str, body: bytes, tokenizer: Tokenizer, served_names: list[str],
           max_model_len: int | None) -> dict[str, Any]:
    """The router's own answer to a raw /tokenize or /detokenize body: the engine's answer for
    the same body (same 400s for a bad body, 404 for a model no engine serves)."""
    model: type[BaseModel] = TokenizeRequest if path == TOKENIZE else DetokenizeRequest
    try:
        req = model.model_validate_json(body)
    except ValidationError as e:
        raise errors.from_validation_errors(list(e.errors())) from None
    if req.model and req.model not in served_names:  # type: ignore[attr-defined]
        raise errors.model_not_found(req.model, served_names)  # type: ignore[attr-defined]
    if isinstance(req, TokenizeRequest):
        return tokenize(tokenizer, req, max_model_len)
    assert isinstance(req, DetokenizeRequest)
    return detokenize(tokenizer, req)
