"""Tool calls (engine/api/tools.py): parsing the request, rendering the prompt and the grammar of
`required` / named choices (reading calls out of text is tests/api/test_tool_stream.py). Pure
functions; the grammar is compiled by the real llguidance over the tiny models' real BPE tokenizer."""

from __future__ import annotations

import pytest

from kvmesh.engine.api import params, tools
from kvmesh.engine.api.errors import APIError
from tests.support.tool_defs import TIME, WEATHER, chat


@pytest.mark.parametrize("kw, param, text", [
    ({"tools": [{"type": "function"}]}, "tools.0", "must be"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name", "letters"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "twice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not in tools (get_weather)"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "must be"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools.0.function.parameters",
     "JSON schema object"),
])
def test_malformed_tools_are_400s_naming_the_field(kw, param, text):
    with pytest.raises(APIError) as e:
        params.check_chat_unsupported(chat(**kw))
    assert e.value.status == 400 and e.value.param == param and text in e.value.message


def test_choices_map_to_setups():
    assert params.tool_setup(chat(tools=[WEATHER], tool_choice="none")) is None
    auto = params.tool_setup(chat(tools=[WEATHER, TIME]))
    assert (auto.choice, auto.parallel, auto.constrained) == ("auto", True, False)
    named = params.tool_setup(chat(tools=[WEATHER, TIME], parallel_tool_calls=True,
                                   tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert (named.choice, named.named, named.parallel) == ("named", "get_time", False)
    spec = params.sampling_params(chat(tools=[WEATHER], tool_choice="required"), 8, None).structured
    assert (spec.kind, spec.param) == ("grammar", "tool_choice")
    with pytest.raises(APIError) as e:
        params.sampling_params(chat(tools=[WEATHER], tool_choice="required", guided_regex="a"), 8, None)
    assert "at most one output constraint" in e.value.message


def test_the_generic_format_renders_tools_calls_and_results_into_the_prompt():
    req = chat(tools=[WEATHER], messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}])
    msgs, kwargs = tools.render_history(params.chat_messages(req.messages), req.messages, params.tool_setup(req),
                                        template_takes_tools=False)
    assert kwargs == {}
    assert msgs[0]["content"].startswith("Be brief.\n\nYou can call functions.")
    assert '"name": "get_weather"' in msgs[0]["content"]
    assert msgs[2]["content"] == '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' \
                                 '</tool_call>'
    assert msgs[3] == {"role": "tool", "content": "<tool_response>\n21 degrees\n</tool_response>"}
    native, kwargs = tools.render_history(params.chat_messages(req.messages), req.messages, params.tool_setup(req),
                                          template_takes_tools=True)
    assert kwargs["tools"][0]["function"]["name"] == "get_weather" and native[2]["tool_calls"]


def test_the_grammar_of_a_named_or_required_choice_compiles_and_is_compact():
    from kvmesh.engine.structured.grammar import GrammarCompiler, StructuredOutput
    from tests.support.tiny_models import TINY_VOCAB, make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    compiler = GrammarCompiler(tok, TINY_VOCAB, (0,))
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        setup = params.tool_setup(chat(tools=[WEATHER, TIME], tool_choice=choice))
        spec = StructuredOutput("grammar", tools.grammar(setup), "tool_choice")
        compiler.prepare(spec)
        for text, ok in (('<tool_call>{"name":"get_weather","arguments":{"city":"Oslo","unit":"celsius"}}</tool_call>',
                          True), ('<tool_call>{"name": "get_weather"', False)):
            matcher = compiler.matcher(spec)
            assert all(matcher.consume_token(t) for t in tok.encode(text)) == ok, text
