"""Token ids of long prompt pieces, remembered: a system prompt that every request repeats is
tokenized once per process, not once per request (the router tokenizes each request to pick an
engine, the engine again to serve it).

A Rust ``tokenizers`` backend first splits the text at its added tokens (``<|im_start|>`` and the
like) and then encodes each stretch between them on its own. So the ids of a text are the ids of
its stretches and added tokens, in order, provided that nothing looks across those splits: no
normalizer, added tokens matched verbatim (no stripping, no word boundaries, not normalized), and
a pre-tokenizer that treats every stretch alike (ByteLevel; a Metaspace prepending its marker to
the first stretch only would not). ``PieceMemo.for_backend`` returns None unless all of that holds,
and the tokenizer then encodes as before.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

MIN_PIECE = 64
"""Stretches shorter than this (characters) are not worth a lookup; they are encoded with their neighbours."""
MAX_PIECE = 16 << 10
ENTRIES = 1024
"""At most ``ENTRIES`` stretches of at most ``MAX_PIECE`` characters are kept (LRU): 16 M characters at worst."""


class PieceMemo:
    def __init__(self, backend: Any, added: list[str]) -> None:
        self._backend = backend
        # Longest first: at one position the longest added token wins, as the backend matches them.
        self._split = re.compile("|".join(re.escape(a) for a in sorted(added, key=len, reverse=True)))
        self._piece = lru_cache(maxsize=ENTRIES)(self._encode_piece)

    @classmethod
    def for_backend(cls, backend: Any) -> PieceMemo | None:
        """A memo for ``backend``, or None where its stretches are not independent (module docstring)."""
        spec = json.loads(backend.to_str())
        if spec.get("normalizer") is not None or (spec.get("pre_tokenizer") or {}).get("type") != "ByteLevel":
            return None
        added = list(backend.get_added_tokens_decoder().values())
        if not added or any(t.lstrip or t.rstrip or t.single_word or t.normalized or not t.content for t in added):
            return None
        return cls(backend, [t.content for t in added])

    def _encode_piece(self, text: str) -> tuple[int, ...]:
        return tuple(self._backend.encode(text, add_special_tokens=False).ids)

    def _encode(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode(self, text: str) -> list[int]:
        """``backend.encode(text, add_special_tokens=False).ids``, with long stretches from the memo."""
        if len(text) < MIN_PIECE:
            return self._encode(text)
        out: list[int] = []
        done = 0  # text[:done] is encoded
        start = 0  # where the current stretch begins
        for m in self._split.finditer(text):
            if MIN_PIECE <= m.start() - start <= MAX_PIECE:
                if done < start:
                    out += self._encode(text[done:start])
                out += self._piece(text[start:m.start()])
                done = m.start()
            start = m.end()
        if MIN_PIECE <= len(text) - start <= MAX_PIECE:
            if done < start:
                out += self._encode(text[done:start])
            out += self._piece(text[start:])
        elif done < len(text):
            out += self._encode(text[done:])
        return out
