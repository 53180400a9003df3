"""What a structured output asks for, and its grammar compiled against the model's tokenizer.

``StructuredOutput`` is plain data (it travels in ``SamplingParams``); ``GrammarCompiler`` turns
it into an llguidance matcher. Compilation (which llguidance bounds but which can take hundreds
of milliseconds for a huge grammar) happens in the caller's thread, never the engine step's: the
server compiles in a worker thread before submitting, and each request then takes a copy of the
cached matcher. JSON is compact by default (no whitespace between tokens), so a small model
cannot spend its ``max_tokens`` on newlines.
"""

from __future__ import annotations

import json
import re
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

_GBNF_RULE = re.compile(r"(?m)^\s*[\w-]+\s*::=")  # a GBNF rule line; Lark rules use "name:"
MAX_SPEC_CHARS = 1 << 20


class InvalidGrammarError(ValueError):
    """A schema, regex or grammar the engine cannot constrain to; the message names the field
    (``param``) and what is wrong with it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class StructuredOutput:
    """One constraint on a request's output.

    ``kind`` is json_schema, json_object, regex, choice or grammar; ``value`` is the JSON schema (as canonical JSON text), the regex,
    the choices (a JSON list of strings), the grammar (Lark, or GBNF/EBNF with ``::=`` rules), or
    "" for json_object. ``param`` is the request field it came from, which errors name.
    """

    kind: str
    value: str = ""
    param: str = "response_format"

    @staticmethod
    def json_schema(schema: Any, param: str) -> StructuredOutput:
        if isinstance(schema, bool) or not isinstance(schema, dict):
            raise InvalidGrammarError(f"'{param}' must be a JSON schema object, got {type(schema).__name__}", param)
        return StructuredOutput("json_schema", json.dumps(schema, sort_keys=True, separators=(",", ":")), param)

    @staticmethod
    def choice(choices: Any, param: str) -> StructuredOutput:
        if (not isinstance(choices, list) or not choices
                or any(not isinstance(c, str) or not c for c in choices)):
            raise InvalidGrammarError(f"'{param}' must be a non-empty list of non-empty strings", param)
        return StructuredOutput("choice", json.dumps(choices), param)

    def cache_key(self) -> tuple[str, str]:
        return (self.kind, self.value)


def grammar_text(spec: StructuredOutput) -> str:
    """The llguidance grammar for ``spec``; raises InvalidGrammarError naming ``spec.param``."""
    import llguidance

    if len(spec.value) > MAX_SPEC_CHARS:
        raise InvalidGrammarError(f"'{spec.param}' is longer than {MAX_SPEC_CHARS} characters", spec.param)
    compact = {"whitespace_flexible": False}
    try:
        if spec.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.value, defaults=compact)
        if spec.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type":"object"}', defaults=compact)
        if spec.kind == "regex":
            with warnings.catch_warnings():  # e.g. "possible nested set": not an error
                warnings.simplefilter("ignore")
                re.compile(spec.value)  # Python's message for what is malformed, before llguidance's
            return llguidance.LLMatcher.grammar_from_regex(spec.value)
        if spec.kind == "choice":
            return llguidance.LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in json.loads(spec.value)))
        if spec.kind == "grammar":
            from llguidance.gbnf_to_lark import gbnf_to_lark

            try:
                text = gbnf_to_lark(spec.value) if _GBNF_RULE.search(spec.value) else spec.value
            except Exception as e:  # noqa: BLE001 - the converter raises bare Exceptions for bad input
                raise ValueError(f"not a valid GBNF grammar: {e}") from None
            return llguidance.LLMatcher.grammar_from_lark(text)
    except re.error as e:
        raise InvalidGrammarError(f"'{spec.param}' is not a valid regular expression: {e}", spec.param) from None
    except (ValueError, RuntimeError, TypeError, AssertionError) as e:
        raise InvalidGrammarError(f"'{spec.param}' cannot be compiled: {e}", spec.param) from None
    raise InvalidGrammarError(f"unknown structured output kind {spec.kind!r}", spec.param)


class GrammarCompiler:
    """Compiled matchers by spec, for one tokenizer (thread-safe; bounded LRU).

    Invariant: a cached matcher is never advanced; ``matcher`` hands out deep copies.
    """

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...],
                 max_entries: int = 256) -> None:
        self._hf = hf_tokenizer
        self._vocab = vocab_size
        self._eos = list(eos_token_ids)
        self._tokenizer: Any = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._max = max_entries
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            import llguidance.hf

            tok = llguidance.hf.from_tokenizer(self._hf, n_vocab=self._vocab, eos_token=self._eos or None)
            with self._lock:
                self._tokenizer = self._tokenizer or tok
        return self._tokenizer

    def prepare(self, spec: StructuredOutput) -> None:
        """Compile ``spec`` into the cache (a no-op when there); raises InvalidGrammarError."""
        self._template(spec)

    def matcher(self, spec: StructuredOutput) -> Any:
        """A fresh matcher at the start of ``spec``'s grammar."""
        return self._template(spec).deep_copy()

    def _template(self, spec: StructuredOutput) -> Any:
        key = spec.cache_key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        import llguidance

        m = llguidance.LLMatcher(self.tokenizer, grammar_text(spec), log_level=0)
        if m.is_error():
            raise InvalidGrammarError(f"'{spec.param}' cannot be compiled: {m.get_error()}", spec.param)
        with self._lock:
            self._cache[key] = m
            while len(self._cache) > self._max:
                self._cache.popitem(last=False)
        return m
