"""Hypothesis strategies for JSON a network client may send: any values, and JSON schemas."""

from __future__ import annotations

from hypothesis import strategies as st

SCALARS = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True, allow_infinity=True)
           | st.text(max_size=20) | st.sampled_from(["", "fake-model", "user", "assistant", "\x00", "é" * 50]))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=10)
# Values json.dumps writes as RFC 8259 JSON (no NaN or Infinity), for parsers that follow the RFC.
FINITE_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12), lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
SMALL_INT = st.integers(-3, 70) | st.sampled_from([2**31, 2**63, -2**63])
# JSON schemas: mostly well-formed, with any keywords and values a client might send.
SCHEMA = st.recursive(
    st.fixed_dictionaries({}, optional={
        "type": st.sampled_from(["object", "string", "integer", "number", "array", "boolean", "null", "nope"]) | JSON,
        "enum": st.lists(SCALARS, max_size=3), "pattern": st.text(max_size=8), "minimum": SCALARS,
        "maxLength": SMALL_INT, "$ref": st.sampled_from(["#/$defs/a", "#", "http://x"]), "format": st.text(max_size=6)}),
    lambda inner: st.fixed_dictionaries({"type": st.just("object")}, optional={
        "properties": st.dictionaries(st.text(max_size=4), inner, max_size=3), "items": inner,
        "required": st.lists(st.text(max_size=4), max_size=2), "additionalProperties": st.booleans() | inner,
        "anyOf": st.lists(inner, max_size=2), "$defs": st.dictionaries(st.just("a"), inner, max_size=1)}),
    max_leaves=6)
