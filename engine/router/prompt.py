"""From a request body to what routing needs: prompt tokens and their block hash chain.

Tokenization calls the engine's own code (``params.completion_prompt_ids``,
``params.chat_prompt_ids`` with the engine's ``Tokenizer``), and hashing the engine's own
``hash_blocks`` with the block size and extra key each engine reports in ``/kv/info``, so a
hash the router computes is the hash the engine publishes for the same tokens.

Analysis never rejects a request: a body the router cannot parse or tokenize is routed without
prefix information and the engine answers it (so 4xx bodies always come from the engine).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pydantic

from kvmesh.engine.block_hash import BlockHash, chain_root, hash_blocks, hit_tokens
from kvmesh.engine.api import params
from kvmesh.engine.api.errors import APIError
from kvmesh.engine.api.protocol import ChatCompletionRequest, CompletionRequest

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass(frozen=True)
class PromptInfo:
    """The routing-relevant part of one request.

    ``token_ids`` is the first prompt's tokens (a multi-prompt completions request goes to one
    engine, and its first prompt stands for the rest), or None when unknown; ``user`` is the
    body's ``user`` field (a session key); ``cache_salt`` its tenant salt, which starts the
    chain from the engine's salted root, so a salted prompt matches only blocks of that salt.
    """

    token_ids: list[int] | None = None
    user: str | None = None
    num_prompt_tokens: int = 0
    cache_salt: str | None = None
    _hashes: dict[tuple[int, bytes], list[BlockHash]] = field(default_factory=dict, compare=False)

    def hashes(self, block_size: int, extra: bytes) -> list[BlockHash]:
        """The prompt's block hash chain for one (block size, extra key); memoized per pair."""
        if self.token_ids is None:
            return []
        key = (block_size, extra)
        got = self._hashes.get(key)
        if got is None:
            got = self._hashes[key] = hash_blocks(self.token_ids, block_size, extra, chain_root(self.cache_salt))
        return got


_json = msgspec.json.Decoder()


def _user_of(body: bytes) -> str | None:
    try:
        doc = _json.decode(body)
    except msgspec.DecodeError:
        return None
    user = doc.get("user") if isinstance(doc, dict) else None
    return user if isinstance(user, str) else None


_encode = msgspec.json.Encoder()


def with_cache_salt(body: bytes, salt_of: Callable[[str | None], str | None]) -> bytes:
    """``body`` with its ``cache_salt`` replaced by ``salt_of(cache_salt)`` (``--isolate-tenants``:
    the key's tenant salt). A body that is not a JSON object goes on unchanged: the engine
    answers it with the 4xx that names what is wrong."""
    try:
        doc = _json.decode(body)
    except msgspec.DecodeError:
        return body
    if not isinstance(doc, dict):
        return body
    own = doc.get("cache_salt")
    salt = salt_of(own if isinstance(own, str) else None)
    if salt == own:
        return body
    doc["cache_salt"] = salt
    return _encode.encode(doc)


def analyze(path: str, body: bytes, tokenizer: Any | None) -> PromptInfo:
    """Tokenize ``body`` as the engine will; without a tokenizer only ``user`` is read."""
    if tokenizer is None:
        return PromptInfo(user=_user_of(body))
    try:
        if path == CHAT:
            chat = ChatCompletionRequest.model_validate_json(body)
            ids = params.chat_prompt_ids(tokenizer, chat)
            if _hashable(ids):
                return PromptInfo(ids, chat.user, len(ids), chat.cache_salt)
        elif path == COMPLETIONS:
            comp = CompletionRequest.model_validate_json(body)
            prompts = params.completion_prompt_ids(tokenizer, comp)
            if _hashable(prompts[0]):
                return PromptInfo(prompts[0], comp.user, sum(len(p) for p in prompts), comp.cache_salt)
    except (pydantic.ValidationError, APIError, ValueError, TypeError):
        pass
    return PromptInfo(user=_user_of(body))


def _hashable(ids: Sequence[int]) -> bool:
    """Token ids the block hash can encode (a prompt of others is the engine's to refuse: 400)."""
    return all(0 <= t < 1 << 32 for t in ids)


def matched_tokens(num_blocks: int, block_size: int, prompt_tokens: int) -> int:
    """Prompt tokens an engine skips given ``num_blocks`` matched blocks (the engine's own rule,
    ``block_hash.hit_tokens``)."""
    return hit_tokens(num_blocks, block_size, prompt_tokens)


def common_hash_spec(specs: Sequence[tuple[int | None, bytes | None]]) -> tuple[int, bytes] | None:
    """The (block size, extra key) most engines report, ignoring engines without one."""
    counts: dict[tuple[int, bytes], int] = {}
    for bs, extra in specs:
        if bs and extra is not None:
            counts[(bs, extra)] = counts.get((bs, extra), 0) + 1
    return max(counts, key=lambda k: counts[k]) if counts else None
