"""Tokenizer, chat template, streaming detokenizer and stop-string matching.

`Tokenizer` wraps a Hugging Face fast tokenizer (built from a GGUF file or a
model directory) and exposes the handful of operations the engine and router
need. Encoding and decoding go straight to the Rust `tokenizers` backend; no
"clean up tokenization spaces" pass is applied, which keeps decoding local (the
text of a token range does not depend on tokens far outside it) so that
`IncrementalDetokenizer` can stream exactly what `Tokenizer.decode` returns.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from functools import cached_property
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmesh.engine.model.piece_memo import PieceMemo

_REPLACEMENT = "\ufffd"
_ROLES = ("system", "user", "assistant", "tool", "developer")


class ChatTemplateError(ValueError):
    """The model has no chat template, or the messages cannot be rendered with it."""


def _byte_fallback_ids(backend: Any) -> frozenset[int]:
    decoder = json.loads(backend.to_str()).get("decoder")
    if "ByteFallback" not in json.dumps(decoder):
        return frozenset()
    vocab = backend.get_vocab(with_added_tokens=False)
    return frozenset(i for t, i in vocab.items() if len(t) == 6 and t.startswith("<0x") and t.endswith(">"))


class TokenizerLoadError(RuntimeError):
    """A tokenizer could not be built from the given file or directory."""


# What `export_files` ships and `from_files` accepts: the text files `save_pretrained` writes
# for a fast tokenizer (tokenizer.json holds the whole Rust tokenizer; the rest are its config,
# special tokens and chat template). Names only, no directories.
_EXPORT_SUFFIXES = (".json", ".jinja", ".txt")
MAX_EXPORT_BYTES = 64 << 20


def _gguf_tokenizer_cache(gguf: Path) -> Path:
    return gguf.with_name(f".{gguf.name}.tokenizer")


def _gguf_stamp(gguf: Path) -> str:
    import transformers

    st = gguf.stat()
    return json.dumps({"size": st.st_size, "mtime_ns": st.st_mtime_ns, "transformers": transformers.__version__})


def _load_hf_from_gguf(gguf: Path, cache: bool) -> Any:
    """Build the HF tokenizer stored in a GGUF file.

    Converting the GGUF vocabulary takes several seconds, so the result is saved
    once beside the file (`.<name>.tokenizer/`, keyed by size, mtime and the
    transformers version) and later loads take a fraction of a second. A
    read-only cache directory just means converting every time.
    """
    from transformers import AutoTokenizer

    cached = _gguf_tokenizer_cache(gguf)
    stamp = _gguf_stamp(gguf)
    if cache:
        try:
            if (cached / "kvmesh-stamp.json").read_text() == stamp:
                return AutoTokenizer.from_pretrained(str(cached))
        except (OSError, ValueError):
            pass
    hf = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if cache:
        tmp = None
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".{gguf.name}.tok-", dir=gguf.parent))
            tmp.chmod(0o755)  # mkdtemp makes it private; the model cache may be shared
            hf.save_pretrained(str(tmp))
            (tmp / "kvmesh-stamp.json").write_text(stamp)
            shutil.rmtree(cached, ignore_errors=True)
            os.replace(tmp, cached)  # atomic; loses harmlessly to a concurrent writer
            tmp = None
        except OSError:
            pass
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
    return hf


def _generation_eos(directory: Path) -> list[int]:
    try:
        eos = json.loads((directory / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError):
        return []
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]


def _normalize_content(content: Any, index: int) -> str:
    """A message's content as a string: a string, None (empty), or a list of OpenAI text parts."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ChatTemplateError(
                    f"message {index}: content parts must be {{'type': 'text', 'text': str}}; got {part!r:.80}"
                )
            texts.append(part["text"])
        return "".join(texts)
    raise ChatTemplateError(
        f"message {index}: content must be a string or a list of text parts, not {type(content).__name__}"
    )


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check chat messages and return copies whose content is a plain string."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"message {i} must be an object with 'role' and 'content', not {type(m).__name__}")
        role = m.get("role")
        if role not in _ROLES:
            raise ChatTemplateError(f"message {i}: role must be one of {', '.join(_ROLES)}; got {role!r}")
        if "content" not in m:
            raise ChatTemplateError(f"message {i} has no 'content'")
        out.append({**m, "content": _normalize_content(m["content"], i)})
    return out


class Tokenizer:
    """A Hugging Face fast tokenizer plus the model's end-of-sequence ids.

    Invariant: `eos_token_ids` is non-empty whenever the tokenizer or the model
    config names an end token; generation stops on any of them.
    """

    def __init__(self, hf_tokenizer: Any, extra_eos_ids: Iterable[int] = ()) -> None:
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise TokenizerLoadError(f"{type(hf_tokenizer).__name__} is not a fast (Rust-backed) tokenizer")
        self.hf = hf_tokenizer
        self._backend = backend
        eos = [hf_tokenizer.eos_token_id] if hf_tokenizer.eos_token_id is not None else []
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys([*eos, *(int(e) for e in extra_eos_ids)]))
        # What `decode(..., skip_special_tokens=True)` drops: the backend's special added tokens.
        added = backend.get_added_tokens_decoder()
        self.special_token_ids: frozenset[int] = frozenset(
            [i for i, t in added.items() if t.special] + list(hf_tokenizer.all_special_ids)
        )
        # At load, not on the first request: it serializes the whole tokenizer (~0.1 s, a fresh
        # engine's first TTFT paid it).
        self._byte_fallback_ids = _byte_fallback_ids(backend)
        self._memo = PieceMemo.for_backend(backend)

    @property
    def byte_fallback_ids(self) -> frozenset[int]:
        """Ids of `<0xNN>` byte tokens when the decoder fuses runs of them (SentencePiece byte fallback).

        Such a run is decoded as one unit: if the run as a whole is not valid
        UTF-8, every byte of it becomes U+FFFD, so text is final only once the
        run has ended. Empty for byte-level (GPT-2 style) tokenizers, whose
        decoding is local.
        """
        return self._byte_fallback_ids

    # ---- construction ------------------------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | Path, extra_eos_ids: Iterable[int] = (), cache: bool = True) -> Tokenizer:
        path = Path(path)
        try:
            hf = _load_hf_from_gguf(path, cache)
        except (OSError, ValueError, KeyError) as e:
            raise TokenizerLoadError(f"could not build a tokenizer from {path}: {e}") from None
        return cls(hf, extra_eos_ids)

    @classmethod
    def from_dir(cls, path: str | Path, extra_eos_ids: Iterable[int] = ()) -> Tokenizer:
        from transformers import AutoTokenizer

        path = Path(path)
        if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
            raise TokenizerLoadError(f"{path} holds no tokenizer (tokenizer.json, tokenizer.model or vocab.json)")
        try:
            hf = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError, KeyError) as e:
            raise TokenizerLoadError(f"could not load the tokenizer in {path}: {e}") from None
        return cls(hf, [*_generation_eos(path), *extra_eos_ids])

    # ---- properties --------------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (base vocabulary plus added tokens)."""
        return len(self.hf)

    @property
    def template_takes_tools(self) -> bool:
        """Whether the chat template renders a ``tools`` argument itself (else api/tools.py's
        generic format is used)."""
        return "tools" in (getattr(self.hf, "chat_template", None) or "")

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def has_chat_template(self) -> bool:
        return bool(self.hf.chat_template)

    @cached_property
    def fingerprint(self) -> str:
        """sha256 (hex) of everything that decides a prompt's token ids: the Rust tokenizer's
        whole definition, the chat template and the BOS id. Equal fingerprints: equal ids for
        every completion prompt and every chat, so equal block hashes (a router and an engine
        compare them before routing by prefix)."""
        h = hashlib.sha256()
        for part in (self._backend.to_str(), self.hf.chat_template or "", str(self.bos_token_id)):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()

    # ---- shipping a tokenizer to a router (GET /kv/tokenizer) ---------------------------------------------------

    def export_files(self) -> dict[str, str]:
        """The tokenizer as ``{file name: text}``, what `from_files` rebuilds it from."""
        with tempfile.TemporaryDirectory(prefix="kvmesh-tok-") as d:
            self.hf.save_pretrained(d)
            return {p.name: p.read_text() for p in sorted(Path(d).iterdir())
                    if p.is_file() and p.suffix in _EXPORT_SUFFIXES}

    def to_payload(self) -> dict[str, Any]:
        """The tokenizer as the JSON body of an engine's ``GET /kv/tokenizer``: its fingerprint,
        end-of-sequence ids and files; `from_payload` is the other side."""
        return {"fingerprint": self.fingerprint, "eos_token_ids": list(self.eos_token_ids),
                "files": self.export_files()}

    @classmethod
    def from_payload(cls, payload: Any) -> Tokenizer:
        """The tokenizer in a `to_payload` body from the network; raises TokenizerLoadError on any
        malformed part, including files that do not rebuild the announced fingerprint."""
        if not isinstance(payload, dict) or not isinstance(payload.get("files"), dict):
            raise TokenizerLoadError("expected a JSON object with 'files' (name -> text)")
        eos = payload.get("eos_token_ids") or []
        if not isinstance(eos, list) or not all(isinstance(e, int) and not isinstance(e, bool) for e in eos):
            raise TokenizerLoadError("'eos_token_ids' must be a list of integers")
        tok = cls.from_files(payload["files"], eos)
        if tok.fingerprint != payload.get("fingerprint"):
            raise TokenizerLoadError(f"the rebuilt tokenizer's fingerprint {tok.fingerprint[:12]} is not the "
                                     f"announced {str(payload.get('fingerprint'))[:12]}")
        return tok

    @classmethod
    def from_files(cls, files: Mapping[str, str], eos_token_ids: Iterable[int] = ()) -> Tokenizer:
        """Rebuild a tokenizer that `export_files` wrote (weights never needed). Raises
        TokenizerLoadError for a malformed set: a name with a path in it or another suffix, too
        many bytes, or files transformers cannot load."""
        total = 0
        for name, text in files.items():
            if (not isinstance(name, str) or not isinstance(text, str) or Path(name).name != name
                    or name.startswith(".") or Path(name).suffix not in _EXPORT_SUFFIXES):
                raise TokenizerLoadError(f"tokenizer file {name!r}: expected a plain file name ending in "
                                         f"{', '.join(_EXPORT_SUFFIXES)} with text content")
            total += len(text)
        if total > MAX_EXPORT_BYTES:
            raise TokenizerLoadError(f"tokenizer files hold {total} bytes, more than {MAX_EXPORT_BYTES}")
        with tempfile.TemporaryDirectory(prefix="kvmesh-tok-") as d:
            for name, text in files.items():
                (Path(d) / name).write_text(text)
            try:
                return cls.from_dir(d, [int(e) for e in eos_token_ids])
            except TokenizerLoadError:
                raise
            except Exception as e:  # noqa: BLE001 - files off the network: transformers fails in many ways
                raise TokenizerLoadError(f"the tokenizer files do not load: {type(e).__name__}: {e}") from None

    # ---- text <-> ids ------------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if self._memo is not None and not add_special_tokens:
            return self._memo.encode(text)  # the same ids, long repeated stretches remembered
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def chat_prompt_text(self, messages: Any, add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
        """Render `messages` with the model's own chat template (e.g. ChatML for SmolLM2)."""
        if not self.has_chat_template:
            raise ChatTemplateError("this model has no chat template; send a plain completion prompt instead")
        msgs = validate_messages(messages)
        from jinja2 import TemplateError

        try:
            text = self.hf.apply_chat_template(
                msgs, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
            )
        except TemplateError as e:  # templates raise to reject e.g. non-alternating roles
            raise ChatTemplateError(f"the model's chat template rejected the messages: {e}") from None
        if not isinstance(text, str):
            raise ChatTemplateError(f"the chat template produced {type(text).__name__}, not text")
        return text

    def apply_chat_template(
        self, messages: Any, add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> list[int]:
        """Token ids of the rendered chat prompt; special tokens come from the template text itself."""
        return self.encode(self.chat_prompt_text(messages, add_generation_prompt, **template_kwargs))


class IncrementalDetokenizer:
    """Turns generated token ids into streamed text deltas.

    Invariants:
    - `"".join(add(...) for each call) + finish() == tokenizer.decode(all ids)`.
    - Emitted text never changes: a delta never ends in a U+FFFD that a later
      token could complete (such text is held back until the next token
      resolves it, or `finish()` flushes it), and with SentencePiece byte
      fallback an open run of `<0xNN>` tokens is held until it ends, because
      the run is decoded as a unit.
    - Work per call is O(tokens since the last emitted chunk): only the window
      `ids[prefix_offset:]` is decoded, never the whole output. `prefix_offset`
      and `read_offset` only ever sit on positions where decoding ended cleanly,
      so decoding from `prefix_offset` agrees with decoding from the start.
      Decoding the window from `prefix_offset` rather than `read_offset` gives
      tokenizers that strip a leading space from the first token the context to
      render `read_offset`'s token correctly.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._byte_ids = tokenizer.byte_fallback_ids
        self._skipped = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self.ids: list[int] = []
        self.text = ""  # everything emitted so far
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _in_byte_run(self) -> bool:
        """True while the output ends in an open run of byte-fallback tokens (skipped specials do not end a run)."""
        for i in range(len(self.ids) - 1, self._read_offset - 1, -1):
            if self.ids[i] not in self._skipped:
                return self.ids[i] in self._byte_ids
        return False

    def _delta(self, final: bool) -> str:
        if len(self.ids) == self._read_offset:
            return ""
        if not final and self._byte_ids and self._in_byte_run():
            return ""
        prefix_text = self._decode(self.ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self.ids[self._prefix_offset :])
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT)):
            return ""  # nothing new yet, or an incomplete character that a later token may finish
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.ids)
        self.text += delta
        return delta

    def add(self, ids: Iterable[int]) -> str:
        """Append newly generated ids; return the text they complete (possibly empty)."""
        self.ids.extend(ids)
        return self._delta(final=False)

    def finish(self) -> str:
        """Flush held-back text (an unfinished character decodes as U+FFFD) at the end of generation."""
        return self._delta(final=True)


@dataclass(frozen=True)
class StopMatch:
    """A stop string found in the output: `text` is the output cut just before it."""

    stop: str
    index: int
    text: str


class StopChecker:
    """Finds stop strings in growing output text and says how much to hold back while streaming.

    Streaming invariant: after each delta, if `check` finds no stop string, the
    client may safely be sent `text[:len(text) - holdback(text)]`; a stop string
    that completes later starts inside the held-back tail, so no client ever sees
    a stop string or any text after one. When `check` finds a match, the final
    output is `match.text` (the stop string itself is not included).
    """

    def __init__(self, stops: Iterable[str]) -> None:
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stops if s))
        self.max_len = max((len(s) for s in self.stops), default=0)

    def __bool__(self) -> bool:
        return bool(self.stops)

    def check(self, text: str, delta_len: int) -> StopMatch | None:
        """Earliest stop string occurrence that ends inside the last `delta_len` characters of `text`.

        Occurrences ending earlier were reported by previous calls, so only the
        tail `text[-(delta_len + max_len - 1):]` is searched.
        """
        if not self.stops or delta_len <= 0:
            return None
        start = max(0, len(text) - delta_len - self.max_len + 1)
        best: StopMatch | None = None
        for stop in self.stops:
            i = text.find(stop, start)
            if i >= 0 and (best is None or i < best.index):
                best = StopMatch(stop=stop, index=i, text=text[:i])
        return best

    def holdback(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        held = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:k]):
                    held = k
                    break
        return held
