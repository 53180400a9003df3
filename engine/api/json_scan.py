"""Incremental JSON syntax, one character at a time: the lexer behind streamed tool calls.

``JsonScanner.feed(ch)`` does O(1) work per character (a container stack and a few scalar
states), so scanning a stream costs the same however finely it is cut and never re-parses a
prefix.

Invariants:
- ``feed`` returns None on the first character after which the text is no longer a prefix of an
  RFC 8259 JSON text (what ``json.loads`` accepts, less its NaN and Infinity); the scanner is then
  dead and must not be fed again. Otherwise every character fed so far is such a prefix.
- ``done`` is true once one complete value (and nothing but whitespace after it) has been read.
  A top-level number is complete only once a character follows it, so ``finish`` reports it.
- The events a character yields tell where values sit: ``("key", depth, raw)`` when an object key
  (``raw``: its quoted text) ends, ``("start", depth)`` when a value starts at this character, and
  ``("end", depth, inclusive)`` when a value ends at this character (``inclusive``) or just before
  it (a number, ended by the character after it). ``depth`` counts the containers around the
  value: 0 for the top-level value, 1 for an outer object's members.
"""

from __future__ import annotations

_WS = " \t\n\r"
_ESCAPES = '"\\/bfnrtu'
_HEX = "0123456789abcdefABCDEF"
_LITERALS = {"t": "true", "f": "false", "n": "null"}
_NO_EVENTS: tuple = ()

# What a container (or the top level) expects next.
_VALUE, _KEY, _KEY_OR_END, _COLON, _COMMA_OR_END, _VALUE_OR_END, _DONE = range(7)
# Number states; the terminal ones may end the number.
_N_SIGN, _N_ZERO, _N_INT, _N_DOT, _N_FRAC, _N_E, _N_ESIGN, _N_EXP = range(8)
_N_TERMINAL = (_N_ZERO, _N_INT, _N_FRAC, _N_EXP)


class JsonScanner:
    """See the module docstring."""

    __slots__ = ("stack", "expect", "scalar", "escape", "hex_left", "num", "lit", "lit_pos", "is_key", "key_raw")

    def __init__(self) -> None:
        self.stack: list[str] = []  # open containers, "{" or "["
        self.expect = _VALUE
        self.scalar: str | None = None  # "str", "num" or "lit" while inside one
        self.escape = False
        self.hex_left = 0
        self.num = _N_SIGN
        self.lit = ""
        self.lit_pos = 0
        self.is_key = False
        self.key_raw: list[str] = []

    @property
    def done(self) -> bool:
        return self.expect == _DONE and self.scalar is None

    def finish(self) -> bool:
        """Whether the text fed is one complete JSON value (ending a top-level number)."""
        if self.scalar == "num" and not self.stack and self.num in _N_TERMINAL:
            self.scalar, self.expect = None, _DONE
        return self.done

    def feed(self, ch: str) -> tuple | list | None:
        """The events of one more character (see the module docstring); None if it breaks the syntax."""
        scalar = self.scalar
        if scalar == "str":
            return self._string(ch)
        if scalar == "lit":
            if ch != self.lit[self.lit_pos]:
                return None
            self.lit_pos += 1
            if self.lit_pos < len(self.lit):
                return _NO_EVENTS
            self.scalar = None
            self._value_done()
            return [("end", len(self.stack), True)]
        if scalar == "num":
            state = self._number(ch)
            if state is not None:
                self.num = state
                return _NO_EVENTS
            if self.num not in _N_TERMINAL:
                return None
            self.scalar = None
            self._value_done()
            end = ("end", len(self.stack), False)
            rest = self._structural(ch)
            return None if rest is None else [end, *rest]
        return self._structural(ch)

    # ---- pieces -----------------------------------------------------------------------
    def _value_done(self) -> None:
        """A value just ended: what its container expects next."""
        self.expect = _COMMA_OR_END if self.stack else _DONE

    def _structural(self, ch: str) -> tuple | list | None:
        if ch in _WS:
            return _NO_EVENTS
        expect = self.expect
        depth = len(self.stack)
        if expect in (_VALUE, _VALUE_OR_END):
            if ch == "]" and expect == _VALUE_OR_END:
                return self._close()
            return self._start_value(ch, depth)
        if expect in (_KEY, _KEY_OR_END):
            if ch == "}" and expect == _KEY_OR_END:
                return self._close()
            if ch != '"':
                return None
            self.scalar, self.is_key, self.key_raw = "str", True, ['"']
            return _NO_EVENTS
        if expect == _COLON:
            if ch != ":":
                return None
            self.expect = _VALUE
            return _NO_EVENTS
        if expect == _COMMA_OR_END:
            top = self.stack[-1]
            if ch == ",":
                self.expect = _KEY if top == "{" else _VALUE
                return _NO_EVENTS
            if ch == ("}" if top == "{" else "]"):
                return self._close()
            return None
        return None  # _DONE: only whitespace may follow

    def _start_value(self, ch: str, depth: int) -> tuple | list | None:
        start = [("start", depth)]
        if ch == "{" or ch == "[":
            self.stack.append(ch)
            self.expect = _KEY_OR_END if ch == "{" else _VALUE_OR_END
            return start
        if ch == '"':
            self.scalar, self.is_key = "str", False
            return start
        if ch == "-" or "0" <= ch <= "9":
            self.scalar = "num"
            self.num = _N_SIGN if ch == "-" else _N_ZERO if ch == "0" else _N_INT
            return start
        lit = _LITERALS.get(ch)
        if lit is None:
            return None
        self.scalar, self.lit, self.lit_pos = "lit", lit, 1
        return start

    def _close(self) -> list:
        self.stack.pop()
        self._value_done()
        return [("end", len(self.stack), True)]

    def _string(self, ch: str) -> tuple | list | None:
        if self.is_key:
            self.key_raw.append(ch)
        if self.hex_left:
            if ch not in _HEX:
                return None
            self.hex_left -= 1
            return _NO_EVENTS
        if self.escape:
            if ch not in _ESCAPES:
                return None
            self.escape = False
            self.hex_left = 4 if ch == "u" else 0
            return _NO_EVENTS
        if ch == "\\":
            self.escape = True
            return _NO_EVENTS
        if ch == '"':
            self.scalar = None
            if self.is_key:
                self.expect = _COLON
                return [("key", len(self.stack), "".join(self.key_raw))]
            self._value_done()
            return [("end", len(self.stack), True)]
        if ord(ch) < 0x20:
            return None
        return _NO_EVENTS

    def _number(self, ch: str) -> int | None:
        """The number state after `ch`, or None when `ch` cannot continue the number."""
        n = self.num
        digit = "0" <= ch <= "9"
        if n == _N_SIGN:
            return _N_ZERO if ch == "0" else _N_INT if digit else None
        if n in (_N_ZERO, _N_INT):
            if digit and n == _N_INT:
                return _N_INT
            return _N_DOT if ch == "." else _N_E if ch in "eE" else None
        if n == _N_DOT:
            return _N_FRAC if digit else None
        if n == _N_FRAC:
            return _N_FRAC if digit else _N_E if ch in "eE" else None
        if n == _N_E:
            return _N_ESIGN if ch in "+-" else _N_EXP if digit else None
        return _N_EXP if digit else None  # _N_ESIGN, _N_EXP
