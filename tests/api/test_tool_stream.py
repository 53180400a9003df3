"""Reading tool calls out of text as it streams (engine/api/tool_stream.py): however the text is
cut (single characters, tokens of a real BPE tokenizer, random splits), the stream sends each
call's first entry then pieces of its arguments that join to the arguments exactly, agrees with
the whole-text parse, and scans every character of a block once."""

from __future__ import annotations

import json

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvmesh.engine.api import params, tool_stream
from kvmesh.engine.api.tool_stream import CallStream, parse_calls
from kvmesh.engine.api.tools import CLOSE, OPEN
from tests.support.fuzz_json import FINITE_JSON
from tests.support.tool_defs import TIME, WEATHER, chat

SETUP = params.tool_setup(chat(tools=[WEATHER, TIME]))
NAMES = ["get_weather", "get_time"]


def run(pieces: list[str]) -> list[dict]:
    stream = CallStream(SETUP)
    deltas = [d for p in pieces for d in stream.feed(p)]
    return deltas + stream.finish()


def rebuild(deltas: list[dict]) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) as a client accumulates them, checking OpenAI's order: a
    call's first entry (id, type, name, arguments "") comes before its pieces; indices count up."""
    content, calls = [], []
    for d in deltas:
        assert len(d) == 1 and ("content" in d) != ("tool_calls" in d), d
        if "content" in d:
            assert d["content"]
            content.append(d["content"])
            continue
        [entry] = d["tool_calls"]
        fn = entry["function"]
        if "id" in entry:
            assert entry["index"] == len(calls) and entry["type"] == "function" and fn["arguments"] == ""
            assert entry["id"].startswith("call_")
            calls.append([fn["name"], ""])
        else:
            assert set(entry) == {"index", "function"} and set(fn) == {"arguments"} and fn["arguments"]
            assert entry["index"] == len(calls) - 1, "pieces belong to the call last opened"
            calls[-1][1] += fn["arguments"]
    return "".join(content), [tuple(c) for c in calls]


def cuts(text: str, points: list[int]) -> list[str]:
    bounds = sorted({0, len(text), *(p % (len(text) + 1) for p in points)})
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def whole(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = parse_calls(text, SETUP)
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


# ---- generated answers ----------------------------------------------------------------------

WHITESPACE = " \t\n\r"
SEPS = st.sampled_from([(",", ":"), (", ", ": "), (" ,\n ", " :\t")])
WS = st.sampled_from(["", " ", "\n", "\n\t "])
TEXT = st.text(alphabet="ab <>/tool_call{}\"\n é😀", max_size=12)


@st.composite
def call_block(draw) -> tuple[str, str, str]:
    """(block text, name, exact arguments text) of one well-formed call."""
    name = draw(st.sampled_from(NAMES))
    args = json.dumps(draw(st.dictionaries(st.text(max_size=5), FINITE_JSON, max_size=3)),
                      separators=draw(SEPS), ensure_ascii=draw(st.booleans()))
    sep = draw(SEPS)
    members = [f'"name"{sep[1]}{json.dumps(name)}', f'"arguments"{sep[1]}{args}']
    if draw(st.booleans()):
        members.reverse()
    if draw(st.booleans()):
        members.insert(draw(st.integers(0, 2)), f'"id"{sep[1]}{json.dumps(draw(FINITE_JSON))}')
    obj = "{" + draw(WS) + sep[0].join(members) + draw(WS) + "}"
    return OPEN + draw(WS) + obj + draw(WS) + CLOSE, name, args


@st.composite
def answer(draw) -> tuple[str, str, list[tuple[str, str]]]:
    """(text, expected content, expected calls): text and calls interleaved; text may hold '<'
    and pieces of the tags, never a whole OPEN. With calls, the content's end is stripped, and
    its start too when a call comes before any text."""
    parts = draw(st.lists(st.one_of(TEXT.map(lambda t: ("text", t)), call_block().map(lambda c: ("call", c))),
                          max_size=5))
    text, texts, calls = "", [], []
    first_call = first_text = None
    for kind, value in parts:
        if kind == "call":
            block, name, args = value
            first_call = len(text) if first_call is None else first_call
            text += block
            calls.append((name, args))
            continue
        if value.strip(WHITESPACE) and first_text is None:
            first_text = len(text)
        text += value
        texts.append(value)
    assume(text.count(OPEN) == len(calls))
    content = "".join(texts)
    if calls:
        content = content.rstrip(WHITESPACE)
        if first_text is None or first_call < first_text:
            content = content.lstrip(WHITESPACE)
    return text, content, calls


@settings(max_examples=300, deadline=None)
@given(data=answer(), points=st.lists(st.integers(0, 10**6), max_size=12))
def test_any_cut_of_an_answer_streams_its_calls_with_exact_arguments(data, points):
    text, content, calls = data
    expect_content = content if not calls else content or None
    assert whole(text) == (expect_content if calls else text, calls)
    for pieces in (cuts(text, points), list(text), [text]):
        got_content, got_calls = rebuild(run(pieces))
        assert got_calls == calls
        assert got_content == (content if calls else text)


def test_token_by_token_with_the_tiny_models_tokenizer():
    """Pieces as the engine's detokenizer hands them out, one token at a time."""
    from tests.support.tiny_models import make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    text = ('I will check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
            '</tool_call>\n<tool_call>{"name":"get_time","arguments":{}}</tool_call>')
    ids = tok.encode(text)
    prefixes = [tok.decode(ids[:k]) for k in range(len(ids) + 1)]
    assert prefixes[-1] == text
    pieces = [b[len(a):] for a, b in zip(prefixes, prefixes[1:])]
    content, calls = rebuild(run(pieces))
    assert content == "I will check."
    assert calls == [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("get_time", "{}")]
    arg_pieces = [d for d in run(pieces) if "tool_calls" in d and "id" not in d["tool_calls"][0]]
    assert len(arg_pieces) > 10, "the arguments arrive in pieces as they are generated"


def test_each_character_of_a_block_is_scanned_once_however_the_text_is_cut(monkeypatch):
    counted = []

    class Counting(tool_stream.JsonScanner):
        def feed(self, ch):
            counted.append(ch)
            return super().feed(ch)

    monkeypatch.setattr(tool_stream, "JsonScanner", Counting)
    body = '{"name": "get_weather", "arguments": {"city": "' + "x" * 500 + '", "unit": "celsius"}}'
    text = f"Sure. {OPEN}{body}{CLOSE} done"
    for pieces in ([text], list(text), cuts(text, list(range(0, len(text), 7)))):
        counted.clear()
        rebuild(run(pieces))
        assert "".join(counted) == body


@pytest.mark.parametrize("text, content, calls", [
    ("no calls here", "no calls here", []),
    ('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', []),
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ('<tool_call>{"name": "get_time"', '<tool_call>{"name": "get_time"', []),
    ('<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>',
     '<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>', []),
    ('<tool_call>{"name": 7}</tool_call>', '<tool_call>{"name": 7}</tool_call>', []),
    ('<tool_call>{"name": "get_time", "name": "get_time", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "get_time", "name": "get_time", "arguments": {}}</tool_call>', []),
    ("<tool_call>[1]</tool_call>", "<tool_call>[1]</tool_call>", []),
    ("a <tool_ca<tool_call><", "a <tool_ca<tool_call><", []),
    # Committed calls stand; what breaks after them is text again.
    ('<tool_call>{"name": "get_time"}</tool_call>', None, [("get_time", "{}")]),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Os', None, [("get_weather", '{"city": "Os')]),
    ('<tool_call>{"name": "get_time", "arguments": {}} oops</tool_call>', "oops</tool_call>", [("get_time", "{}")]),
    ('<tool_call>{"name": "get_time", "arguments": {}, "arguments": {}}</tool_call>',
     '": {}}</tool_call>', [("get_time", "{}")]),
    ('<tool_call>{"name": "get_time", "arguments": {}}<tool_call>{"name": "get_time", "arguments": {"a": 1}}',
     None, [("get_time", "{}"), ("get_time", '{"a": 1}')]),
    ('x <tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n\n y \n', "x \n\n y", [("get_time", "{}")]),
    (' \n<tool_call>{"name": "get_time", "arguments": {}}</tool_call> y', "y", [("get_time", "{}")]),
])
def test_edge_cases_read_alike_whole_and_one_character_at_a_time(text, content, calls):
    assert whole(text) == (content if calls else text, calls)
    got_content, got_calls = rebuild(run(list(text)))
    assert got_content == (content or "" if calls else text)
    assert got_calls == calls


def test_the_official_client_accumulates_the_stream_into_the_same_calls():
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    from kvmesh.engine.server import responses

    text = ('Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
            '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    state = ChatCompletionStreamState(input_tools=[WEATHER, TIME])
    chunks = [responses.chat_chunk("c", 0, "m", 0, {"role": "assistant", "content": ""})]
    chunks += [responses.chat_chunk("c", 0, "m", 0, d) for d in run(list(text))]
    chunks.append(responses.chat_chunk("c", 0, "m", 0, {}, "tool_calls"))
    for c in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(c))
    message = state.get_final_completion().choices[0].message
    content, calls = whole(text)
    assert message.content == content == "Let me look."
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == calls
    assert [json.loads(a) for _, a in calls] == [{"city": "Oslo", "unit": "celsius"}, {}]
