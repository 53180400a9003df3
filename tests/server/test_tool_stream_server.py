"""Streamed tool calls from a real `kvmesh serve` on the tiny random Llama, read by the official
`openai` client: each call's first delta (index, id, type, name, empty arguments), then pieces of
its arguments as they are generated, which the client's stream helper accumulates into exactly
the calls of the same request unstreamed. Greedy, so both runs generate the same text.

The weights are random: a named choice is a call because of its grammar, and the `auto` request
gets its Hermes-style text from a `guided_grammar` (the parser does not know the difference).
"""

from __future__ import annotations

import json

import openai
import pytest

from kvmesh.engine.api import params, tools
from kvmesh.engine.api.protocol import ChatCompletionRequest
from tests.support.processes import ServerProcess
from tests.support.tiny_models import make_tiny_hf_model

pytestmark = pytest.mark.slow  # one real server process

UNIT = {"type": "function", "function": {
    "name": "set_unit", "strict": True, "description": "Set the unit and the number of days of the forecast",
    "parameters": {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                                   "days": {"enum": [1, 2, 3]}},
                   "required": ["unit", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "strict": True, "parameters": {"type": "object", "properties": {}}}}
MESSAGES = [{"role": "user", "content": "Forecast for Paris in celsius, two days."}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    # Room for the rendered tool definitions (about 450 tokens of the tiny BPE) and the answer.
    model = make_tiny_hf_model("llama", tmp_path_factory.mktemp("tools") / "model", max_position_embeddings=1024)
    server = ServerProcess("--model", str(model), "--served-model-name", "tiny", "--dtype", "float32",
                           "--block-size", "4", "--num-kv-blocks", "512", "--max-model-len", "1024").start()
    try:
        yield openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=300)
    finally:
        server.stop()


def _auto_grammar() -> str:
    """Text the `auto` parser reads as words then one call of set_unit (the grammar a named choice
    gets, after a fixed sentence)."""
    setup = params.tool_setup(ChatCompletionRequest(messages=MESSAGES, tools=[UNIT], tool_choice="required",
                                                    parallel_tool_calls=False))
    return tools.grammar(setup).replace("start: call", 'start: "Checking. " call', 1)


@pytest.mark.parametrize("how", ["named", "auto"])
def test_a_streamed_call_arrives_in_pieces_that_rebuild_the_unstreamed_call(client, how):
    kw = dict(model="tiny", messages=MESSAGES, tools=[UNIT, CLOCK], temperature=0, max_tokens=120)
    if how == "named":
        kw["tool_choice"] = {"type": "function", "function": {"name": "set_unit"}}
    else:
        kw["extra_body"] = {"guided_grammar": _auto_grammar()}
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls", whole
    assert whole.message.content == (None if how == "named" else "Checking.")
    [call] = whole.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "set_unit" and args["unit"] in ("celsius", "fahrenheit") and args["days"] in (1, 2, 3)

    with client.chat.completions.stream(**kw) as stream:
        entries = [tc for event in stream if event.type == "chunk"
                   for ch in event.chunk.choices for tc in ch.delta.tool_calls or []]
        final = stream.get_final_completion().choices[0]
    first, *pieces = entries
    assert (first.index, first.type, first.function.name, first.function.arguments) == (0, "function", "set_unit", "")
    assert first.id.startswith("call_")
    assert len(pieces) > 3 and all(p.index == 0 and p.id is None and p.function.name is None for p in pieces)
    assert "".join(p.function.arguments for p in pieces) == call.function.arguments
    assert final.finish_reason == "tool_calls"
    assert (final.message.content or None) == whole.message.content
    assert [(c.id, c.function.name, c.function.arguments) for c in final.message.tool_calls] == [
        (first.id, "set_unit", call.function.arguments)]
