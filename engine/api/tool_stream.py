"""Tool calls read out of the model's text as it is generated: Hermes-style ``<tool_call>`` JSON,
streamed as OpenAI streams calls (a first ``delta.tool_calls`` entry with index, id, type, name
and empty arguments, then entries with the same index carrying pieces of the arguments).

Invariants:
- One reader for streams and whole answers: ``parse_calls(text)`` is a ``CallStream`` fed the
  whole text and finished, so a stream and the response body agree on the content and the calls
  however the text is cut.
- A call's arguments are the model's own text of its arguments object, verbatim: the
  concatenation of a call's argument pieces equals its final ``function.arguments`` exactly.
- Linear: text outside blocks is searched with ``str.find`` (a held tail is shorter than
  ``<tool_call>``); inside a block each character goes once through a ``JsonScanner``. Nothing is
  ever re-parsed, so a stream cut into single characters costs what one whole text costs.
- Commit: a block becomes call number ``index`` once its JSON object has named a listed function
  (a string ``"name"``) and its ``"arguments"`` value has begun as an object (or the object
  closed without one: arguments ``{}``); from then on the call stands. A block that breaks first
  (not JSON, an unknown or non-string name, arguments that are not an object, a repeated key, no
  end) is content, exactly as generated. After a commit, a syntax break, a repeated key, or
  anything but whitespace and ``</tool_call>`` after the object ends the block there and the
  rest is read as text again; arguments cut short (``max_tokens``) stay as generated, as OpenAI
  returns them.
- Nothing is dropped but a committed call's framing (``<tool_call>``, the JSON around the
  arguments, whitespace and ``</tool_call>`` after it), whitespace that starts the content when a
  call came first, and whitespace that ends the content when there are calls: every other
  character is content, in order. Without calls the content is the text.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from kvmesh.engine.api.json_scan import JsonScanner
from kvmesh.engine.api.tools import CLOSE, OPEN, ToolSetup

_WS = " \t\n\r"
assert OPEN.rfind("<") == 0, "the text scan finds a block's start by its only '<'"

_TEXT, _BLOCK, _TAIL = range(3)
_NONE, _READING, _READ = range(3)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class CallStream:
    """Reads one choice's text; see the module docstring. ``feed`` and ``finish`` return deltas
    in order: ``{"content": text}`` or ``{"tool_calls": [entry]}``, one entry each."""

    def __init__(self, setup: ToolSetup) -> None:
        self.names = {f.name for f in setup.functions}
        self.count = 0  # calls committed so far
        self.mode = _TEXT
        self.pending = ""  # _TEXT: a tail that may grow into OPEN
        self.ws: list[str] = []  # trailing whitespace held back (see _content)
        self.started = False  # content other than whitespace has been sent
        self.out: list[list[Any]] = []
        self._new_block()

    def _new_block(self) -> None:
        self.scan = JsonScanner()
        self.held: list[str] = []  # the block's text until it commits
        self.key: str | None = None  # the outer object's current key
        self.keys: set[str] = set()
        self.name_raw: list[str] | None = None  # the name's quoted text while it is read
        self.name: str | None = None
        self.args: list[str] = []  # the arguments' text until the commit
        self.args_state = _NONE
        self.call: int | None = None  # the committed call's index
        self.tail: list[str] = []  # _TAIL: whitespace, then the part of CLOSE read
        self.tail_ws = 0

    # ---- public -----------------------------------------------------------------------
    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas that ``text``, the next piece of the answer, completes."""
        self.out = []
        self._run(text)
        return self._deltas()

    def finish(self) -> list[dict[str, Any]]:
        """The deltas of whatever is still held at the end of the answer."""
        self.out = []
        if self.mode == _TEXT:
            self._content(self.pending)
            self.pending = ""
        elif self.call is None:
            self._content("".join(self.held))
        self.mode = _TEXT
        if not self.count:
            self._emit("content", "".join(self.ws))
        self.ws = []
        return self._deltas()

    # ---- text outside blocks ----------------------------------------------------------
    def _run(self, s: str) -> None:
        i = 0
        while i < len(s):
            if self.mode == _TEXT:
                i = self._text(s, i)
                continue
            ch = s[i]
            i += 1
            back = self._block(ch) if self.mode == _BLOCK else self._tail(ch)
            if back:
                self._run(back)

    def _text(self, s: str, i: int) -> int:
        if self.pending:
            while i < len(s) and len(self.pending) < len(OPEN) and s[i] == OPEN[len(self.pending)]:
                self.pending += s[i]
                i += 1
            if self.pending == OPEN:
                self.pending = ""
                self._open()
                return i
            if i == len(s):
                return i
            # No suffix of the held tail can start OPEN: its only "<" is its first character.
            self._content(self.pending)
            self.pending = ""
        k = s.find(OPEN, i)
        if k != -1:
            self._content(s[i:k])
            self._open()
            return k + len(OPEN)
        lt = s.rfind("<", max(i, len(s) - len(OPEN) + 1))
        if lt != -1 and OPEN.startswith(s[lt:]):
            self._content(s[i:lt])
            self.pending = s[lt:]
        else:
            self._content(s[i:])
        return len(s)

    def _open(self) -> None:
        self.mode = _BLOCK
        self._new_block()
        self.held.append(OPEN)

    # ---- inside a block ---------------------------------------------------------------
    def _block(self, ch: str) -> str | None:
        """Read one character of a block; the text to read again as plain text if it broke."""
        events = self.scan.feed(ch)
        if events is None:
            return self._break(ch)
        in_name, in_args = self.name_raw is not None, self.args_state == _READING
        done = member_end = False
        for kind, depth, *rest in events:
            if depth == 0:
                if kind == "start" and ch != "{":
                    return self._break(ch)
                done = kind == "end"
            elif depth != 1:
                continue
            elif kind == "end":
                member_end = True
            elif kind == "key":
                self.key = json.loads(rest[0])
                if self.key in ("name", "arguments"):
                    if self.key in self.keys:
                        return self._break(ch)
                    self.keys.add(self.key)
            elif self.key == "name":  # a start
                if ch != '"':
                    return self._break(ch)
                self.name_raw, in_name = [], True
            elif self.key == "arguments":
                if ch != "{":
                    return self._break(ch)
                self.args_state, in_args = _READING, True
        if in_name:
            self.name_raw.append(ch)  # type: ignore[union-attr]
            if member_end:
                name = json.loads("".join(self.name_raw))  # type: ignore[arg-type]
                self.name_raw = None
                if name not in self.names:
                    return self._break(ch)
                self.name = name
        if in_args:
            if self.call is None:
                self.args.append(ch)
            else:
                self._emit("args", ch)
            if member_end:
                self.args_state = _READ
        if self.call is None:
            self.held.append(ch)
            if self.name is not None and (self.args_state != _NONE or done):
                self._commit()
            elif done:
                self._content("".join(self.held))
                self.mode = _TEXT
                return None
        if done:
            self.mode = _TAIL
        return None

    def _commit(self) -> None:
        self.call = self.count
        self.count += 1
        self._emit("call", {"index": self.call, "id": call_id(), "type": "function",
                            "function": {"name": self.name, "arguments": ""}})
        self._emit("args", "".join(self.args) if self.args_state != _NONE else "{}")
        self.held = []

    def _break(self, ch: str) -> str:
        """The block ends before `ch`: uncommitted, its text is content; `ch` is read again."""
        if self.call is None:
            self._content("".join(self.held))
        self.mode = _TEXT
        return ch

    def _tail(self, ch: str) -> str | None:
        matched = len(self.tail) - self.tail_ws
        if matched == 0 and ch in _WS:
            self.tail.append(ch)
            self.tail_ws += 1
            return None
        if ch == CLOSE[matched]:
            self.tail.append(ch)
            if matched + 1 == len(CLOSE):
                self.mode = _TEXT
            return None
        self.mode = _TEXT
        return "".join(self.tail) + ch

    # ---- output -----------------------------------------------------------------------
    def _content(self, s: str) -> None:
        """Text for the content. Trailing whitespace is held until more text comes: so the
        content's start is dropped when a call came first, and its end when there are calls."""
        if not s:
            return
        if not s.rstrip(_WS):
            self.ws.append(s)
            return
        if self.ws:
            s = "".join(self.ws) + s
        body = s.rstrip(_WS)
        self.ws = [s[len(body):]]
        if not self.started and self.count:
            body = body.lstrip(_WS)
        self.started = True
        self._emit("content", body)

    def _emit(self, kind: str, value: Any) -> None:
        """Queue output; consecutive content, or pieces of one call's arguments, join up."""
        if not value:
            return
        index = self.call if kind == "args" else None
        if kind != "call" and self.out and self.out[-1][0] == kind and self.out[-1][1] == index:
            self.out[-1][2].append(value)
        else:
            self.out.append([kind, index, value if kind == "call" else [value]])

    def _deltas(self) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for kind, index, value in self.out:
            if kind == "content":
                deltas.append({"content": "".join(value)})
            elif kind == "call":
                deltas.append({"tool_calls": [value]})
            else:
                deltas.append({"tool_calls": [{"index": index, "function": {"arguments": "".join(value)}}]})
        self.out = []
        return deltas


def parse_calls(text: str, setup: ToolSetup) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a whole answer: what a ``CallStream`` reads from it. The content
    is None when there are calls and no other text; without calls it is ``text`` itself."""
    stream = CallStream(setup)
    content: list[str] = []
    calls: list[dict[str, Any]] = []
    for delta in stream.feed(text) + stream.finish():
        if "content" in delta:
            content.append(delta["content"])
            continue
        entry = delta["tool_calls"][0]
        if "id" in entry:
            calls.append({"id": entry["id"], "type": "function",
                          "function": {"name": entry["function"]["name"], "arguments": ""}})
        else:
            calls[entry["index"]]["function"]["arguments"] += entry["function"]["arguments"]
    joined = "".join(content)
    return (joined or None) if calls else joined, calls
