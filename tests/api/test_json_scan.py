"""The incremental JSON scanner (engine/api/json_scan.py): it accepts what an RFC 8259 parser
accepts, one character at a time, and its events delimit the values of an object's members."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.engine.api.json_scan import JsonScanner
from tests.support.fuzz_json import FINITE_JSON

SEPARATORS = st.sampled_from([(",", ":"), (", ", ": "), (" ,\n", " :\t")])


def scan(text: str) -> tuple[int, list[tuple[int, tuple]]]:
    """How many characters the scanner accepted (len(text) + 1 if it also finished) and its events."""
    s, events = JsonScanner(), []
    for i, ch in enumerate(text):
        ev = s.feed(ch)
        if ev is None:
            return i, events
        events += [(i, e) for e in ev]
    return len(text) + s.finish(), events


def rfc_json(text: str) -> bool:
    def refuse(name: str) -> None:
        raise ValueError(name)

    try:
        json.loads(text, parse_constant=refuse)
    except ValueError:
        return False
    return True


@settings(max_examples=300, deadline=None)
@given(value=FINITE_JSON, seps=SEPARATORS, indent=st.sampled_from([None, 1]), ascii_=st.booleans(),
       pad=st.sampled_from(["", " ", "\n\t "]))
def test_every_prefix_of_json_is_accepted_and_the_whole_is_complete(value, seps, indent, ascii_, pad):
    text = pad + json.dumps(value, separators=seps, indent=indent, ensure_ascii=ascii_) + pad
    accepted, events = scan(text)
    assert accepted == len(text) + 1
    starts = [e for _, e in events if e[0] == "start" and e[1] == 0]
    assert starts == [("start", 0)]


@settings(max_examples=500, deadline=None)
@given(text=st.text(alphabet='{}[]":,.-+eE0123456789 tfnrulasbx\\u\n', max_size=24))
def test_a_complete_text_is_what_an_rfc_parser_accepts(text):
    accepted, _ = scan(text)
    assert (accepted == len(text) + 1) == rfc_json(text), text


@settings(max_examples=200, deadline=None)
@given(value=st.dictionaries(st.text(max_size=6), FINITE_JSON, max_size=5), seps=SEPARATORS)
def test_depth_one_events_delimit_each_members_key_and_value(value, seps):
    text = json.dumps(value, separators=seps)
    _, events = scan(text)
    keys = [json.loads(e[2]) for _, e in events if e[0] == "key" and e[1] == 1]
    starts = [i for i, e in events if e[0] == "start" and e[1] == 1]
    ends = [i + 1 if e[2] else i for i, e in events if e[0] == "end" and e[1] == 1]
    assert keys == list(value)
    assert [json.loads(text[a:b]) for a, b in zip(starts, ends)] == list(value.values())


@pytest.mark.parametrize("text, accepted", [
    ('{"a": tru', 9), ("01", 1), ("[1,]", 3), ('"\\x"', 2), ('"\x01"', 1), ("-", 1), ("1.", 2), ("1e+", 3),
    ("NaN", 0), ("{} {}", 3), ('{"a" 1}', 5), ("[1 2]", 3)])
def test_breaks_are_found_at_the_first_bad_character(text, accepted):
    assert scan(text)[0] == accepted


def test_a_top_level_number_is_complete_only_at_the_end():
    s = JsonScanner()
    assert [s.feed(c) for c in "12"] == [[("start", 0)], ()] and not s.done
    assert s.finish() and s.done
