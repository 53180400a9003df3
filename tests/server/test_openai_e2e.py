"""The official `openai` client against a real `kvmesh serve` (default model, fp32).

One server for the whole module; expected outputs come from the offline
engine (`kvmesh.engine.llm.LLM`) in this process, itself held to transformers
by the engine's parity suite.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import httpx
import openai
import pytest

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.sampling import SamplingParams

from tests.support.processes import ServerProcess

pytestmark = pytest.mark.slow  # a real server on the default model, 61 tests: about 2.5 min

MODEL = "smollm2-135m-instruct"
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "Explain in one sentence what a CPU does.",
]
COMPLETION_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess("--dtype", "float32").start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def offline():
    from kvmesh.engine.llm import LLM

    return LLM(EngineConfig(model="default", dtype="float32"))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=600)


def _chat(q: str) -> list[dict]:
    return [{"role": "user", "content": q}]


def _greedy(max_tokens: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


# ---- parity with the offline engine ------------------------------------------------------------


def test_models_lists_the_default_model(client):
    ids = [m.id for m in client.models.list().data]
    # The model's own name, then the name the server was started with (`--model default`).
    assert ids == [MODEL, "default"]


def test_chat_greedy_matches_offline_engine(client, offline):
    expected = offline.chat([_chat(q) for q in QUESTIONS], _greedy())
    for q, exp in zip(QUESTIONS, expected):
        r = client.chat.completions.create(model=MODEL, messages=_chat(q), temperature=0, max_tokens=MAX_TOKENS)
        assert r.choices[0].message.content == exp.text
        assert r.choices[0].finish_reason == exp.finish_reason
        assert r.usage.completion_tokens == len(exp.token_ids)
        assert r.usage.prompt_tokens == len(exp.prompt_token_ids)


def test_chat_streaming_matches_offline_engine(client, offline):
    expected = offline.chat([_chat(q) for q in QUESTIONS], _greedy())
    for q, exp in zip(QUESTIONS, expected):
        stream = client.chat.completions.create(model=MODEL, messages=_chat(q), temperature=0,
                                                max_tokens=MAX_TOKENS, stream=True,
                                                stream_options={"include_usage": True})
        text, finish, usage, roles = [], None, None, []
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                if c.delta.role:
                    roles.append(c.delta.role)
                if c.delta.content:
                    text.append(c.delta.content)
                if c.finish_reason:
                    finish = c.finish_reason
        assert roles == ["assistant"]
        assert "".join(text) == exp.text
        assert finish == exp.finish_reason
        assert usage is not None and usage.completion_tokens == len(exp.token_ids)


def test_completions_greedy_matches_offline_engine(client, offline):
    expected = offline.generate(COMPLETION_PROMPTS, _greedy())
    for prompt, exp in zip(COMPLETION_PROMPTS, expected):
        r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS)
        assert r.choices[0].text == exp.text
        assert r.choices[0].finish_reason == exp.finish_reason
        s = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS,
                                      stream=True)
        assert "".join(c.choices[0].text for c in s if c.choices) == exp.text


def test_completions_batch_prompts_and_token_ids(client, offline):
    """A list of prompts gives choices prompt-major; token-id prompts equal their text form."""
    expected = offline.generate(COMPLETION_PROMPTS[:2], _greedy(8))
    r = client.completions.create(model=MODEL, prompt=COMPLETION_PROMPTS[:2], temperature=0, max_tokens=8, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [expected[0].text] * 2 + [expected[1].text] * 2
    assert r.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)
    ids = offline.tokenizer.encode(COMPLETION_PROMPTS[0])
    r2 = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=8)
    assert r2.choices[0].text == expected[0].text


def test_stop_strings_match_offline_engine(client, offline):
    exp = offline.chat([_chat(QUESTIONS[0])], _greedy(stop=["Paris"]))[0]
    assert exp.finish_reason == "stop" and "Paris" not in exp.text
    r = client.chat.completions.create(model=MODEL, messages=_chat(QUESTIONS[0]), temperature=0,
                                       max_tokens=MAX_TOKENS, stop="Paris")
    assert r.choices[0].message.content == exp.text
    assert r.choices[0].finish_reason == "stop"
    s = client.chat.completions.create(model=MODEL, messages=_chat(QUESTIONS[0]), temperature=0,
                                       max_tokens=MAX_TOKENS, stop=["Paris"], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in s if c.choices) == exp.text


def test_prefix_cache_reported_in_usage(client):
    msgs = _chat("Tell me about the history of the printing press in two sentences.")
    client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=4)
    r = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=4)
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < r.usage.prompt_tokens
    assert cached % 16 == 0  # whole blocks only (block size 16)


def test_cache_salt_separates_tenants_prefixes(client):
    """vLLM's cache_salt over HTTP: a salted request reuses only what the same salt cached, and
    the answer is the same either way."""
    msgs = _chat("Describe the water cycle for a ten-year-old, in three short sentences.")

    def ask(salt=None):
        body = {"cache_salt": salt} if salt else None
        r = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=6, extra_body=body)
        return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens

    text, _ = ask()
    assert ask("tenant-a") == (text, 0)  # the unsalted copy is invisible to a salted tenant
    assert ask("tenant-b") == (text, 0)
    again, cached = ask("tenant-a")
    assert again == text and cached > 0
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        ask("x" * 300)


def test_seeded_sampling_is_reproducible_and_choices_differ(client):
    kw = dict(model=MODEL, messages=_chat("Invent a name for a cat."), temperature=1.0, max_tokens=12, seed=1234)
    a = client.chat.completions.create(n=3, **kw)
    b = client.chat.completions.create(n=3, **kw)
    one = client.chat.completions.create(n=1, **kw)
    texts_a = [c.message.content for c in sorted(a.choices, key=lambda c: c.index)]
    texts_b = [c.message.content for c in sorted(b.choices, key=lambda c: c.index)]
    assert texts_a == texts_b
    assert len(set(texts_a)) > 1  # distinct per-choice seeds
    assert one.choices[0].message.content == texts_a[0]  # choice 0 uses the request's seed
    fixed = client.chat.completions.create(n=3, extra_body={"ignore_eos": True}, **kw)
    assert fixed.usage.completion_tokens == 3 * 12  # completion tokens sum over choices
    assert fixed.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once


def test_logprobs_chat_and_completions(client, offline):
    r = client.chat.completions.create(model=MODEL, messages=_chat(QUESTIONS[0]), temperature=0, max_tokens=8,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        # greedy: the chosen token is the most likely one
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)
        assert entry.logprob <= 0.0
    text_tokens = "".join(e.token for e in content if e.token != "<|im_end|>")
    assert text_tokens == r.choices[0].message.content

    c = client.completions.create(model=MODEL, prompt=COMPLETION_PROMPTS[0], temperature=0, max_tokens=6, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == c.choices[0].text
    assert lp.text_offset[0] == 0
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs)


def test_logit_controls_shape_what_the_server_generates(client, offline):
    """Penalties, logit bias and min_tokens reach the engine: the server's greedy tokens equal the
    offline engine's with the same controls, and a forced token and a banned EOS are visible."""
    controls = dict(frequency_penalty=1.5, presence_penalty=0.5)
    q = "Write a haiku about the sea."
    exp = offline.chat([_chat(q)], _greedy(ignore_eos=True, **controls))[0]
    r = client.chat.completions.create(model=MODEL, messages=_chat(q), temperature=0, max_tokens=MAX_TOKENS,
                                       extra_body={"ignore_eos": True}, **controls)
    assert r.choices[0].message.content == exp.text
    plain = client.chat.completions.create(model=MODEL, messages=_chat(q), temperature=0, max_tokens=MAX_TOKENS,
                                           extra_body={"ignore_eos": True})
    assert plain.choices[0].message.content != exp.text, "the penalties changed nothing"
    tok = offline.engine.tokenizer
    forced = tok.encode(" banana")[0]
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0,
                                  logit_bias={str(forced): 100})
    assert r.choices[0].text == tok.decode([forced] * 3)
    # Without min_tokens the answer ends with EOS after n tokens; with min_tokens=n+3 EOS is masked
    # until then.
    msgs = _chat("What is the capital of France?")
    plain_ans = offline.chat([msgs], _greedy(max_tokens=64))[0]
    assert plain_ans.finish_reason == "stop"
    n = len(plain_ans.token_ids)
    longer = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=n + 12,
                                            extra_body={"min_tokens": n + 3})
    assert longer.usage.completion_tokens >= n + 3


def test_structured_outputs_with_the_official_clients_parse_helper(client, offline):
    """`chat.completions.parse` with a pydantic model sends a strict json_schema; the answer
    parses into the model every time (sampled, several choices), equals the offline engine's
    constrained greedy answer, and streaming gives the same text."""
    import pydantic

    from kvmesh.engine.structured.grammar import StructuredOutput

    class City(pydantic.BaseModel):
        name: str
        country: str
        population: int

    msgs = _chat("Describe Paris as JSON with its name, country and population.")
    r = client.chat.completions.parse(model=MODEL, messages=msgs, response_format=City, temperature=0,
                                      max_tokens=60)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, City) and r.choices[0].finish_reason == "stop"
    schema = openai.lib._pydantic.to_strict_json_schema(City)
    exp = offline.chat([msgs], _greedy(max_tokens=60, structured=StructuredOutput.json_schema(
        schema, "response_format.json_schema.schema")))[0]
    assert r.choices[0].message.content == exp.text
    many = client.chat.completions.parse(model=MODEL, messages=msgs, response_format=City, temperature=1.0,
                                         seed=5, n=4, max_tokens=80)
    assert all(isinstance(c.message.parsed, City) for c in many.choices if c.finish_reason == "stop")
    assert sum(c.finish_reason == "stop" for c in many.choices) >= 3
    stream = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=60, stream=True,
                                            response_format={"type": "json_schema", "json_schema": {
                                                "name": "City", "schema": schema, "strict": True}})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == exp.text


def test_json_object_choice_and_regex_constrain_both_apis(client):
    obj = client.chat.completions.create(model=MODEL, messages=_chat("Give me a JSON object about cats."),
                                         temperature=0, max_tokens=60, response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    pick = client.chat.completions.create(model=MODEL, messages=_chat("Is the sky blue?"), temperature=0,
                                          max_tokens=10, extra_body={"guided_choice": ["yes", "no"]})
    assert pick.choices[0].message.content in ("yes", "no") and pick.choices[0].finish_reason == "stop"
    code = client.completions.create(model=MODEL, prompt="A flight number:", max_tokens=12, temperature=0.7,
                                     seed=1, extra_body={"guided_regex": "[A-Z]{2}[0-9]{3,4}"})
    assert re.fullmatch("[A-Z]{2}[0-9]{3,4}", code.choices[0].text)


_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}


def test_a_named_tool_call_has_arguments_of_the_functions_schema(client):
    """tool_choice naming a function is enforced by grammar: the call names it and its arguments
    parse into the schema's object, streamed or not (the official client's typed objects)."""
    msgs = _chat("What is the weather like in Paris today?")
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[_WEATHER], tool_choice=choice,
                                       temperature=0, max_tokens=60)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    call = c.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and call.id.startswith("call_") and call.type == "function"
    assert set(args) == {"city", "unit"} and isinstance(args["city"], str) and args["unit"] in ("celsius", "fahrenheit")
    stream = client.chat.completions.create(model=MODEL, messages=msgs, tools=[_WEATHER], tool_choice=choice,
                                            temperature=0, max_tokens=60, stream=True)
    deltas, reasons = [], []
    for chunk in stream:
        for ch in chunk.choices:
            deltas += ch.delta.tool_calls or []
            reasons.append(ch.finish_reason)
    first, *pieces = deltas  # OpenAI's shape: the name with empty arguments, then their pieces
    assert (first.function.name, first.function.arguments) == ("get_weather", "")
    assert "".join(p.function.arguments for p in pieces) == call.function.arguments
    assert reasons[-1] == "tool_calls"
    required = client.chat.completions.create(model=MODEL, messages=msgs, tools=[_WEATHER], tool_choice="required",
                                              temperature=0.8, seed=3, max_tokens=80)
    assert required.choices[0].message.tool_calls, required.choices[0]


def test_a_tool_result_in_the_history_is_answered(client, server):
    """An assistant turn with tool_calls and a tool turn render into the prompt (the generic
    format: the default model's template has no tools); the model answers in text."""
    msgs = [*_chat("What is the weather like in Paris today?"),
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 degrees"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[_WEATHER], temperature=0, max_tokens=40)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    counted = httpx.post(server.url("/tokenize"), json={"messages": msgs, "tools": [_WEATHER]}, timeout=60).json()
    bare = httpx.post(server.url("/tokenize"), json={"messages": msgs}, timeout=60).json()
    assert counted["count"] == r.usage.prompt_tokens > bare["count"], "the tool definitions are part of the prompt"


def test_echo_with_logprobs_scores_the_prompt_as_the_engine_does(client, server, offline):
    """Completions' echo + logprobs carries the prompt's tokens (the first without a logprob, as
    OpenAI sends it) then the completion's; vLLM's prompt_logprobs gives the same values."""
    text = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=text, max_tokens=3, temperature=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    ids = offline.engine.tokenizer.encode(text)
    assert len(lp.tokens) == len(ids) + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert r.choices[0].text.startswith(text) and lp.text_offset[0] == 0
    want = offline.generate([ids], _greedy(max_tokens=1, prompt_logprobs=2))[0].prompt_logprobs
    assert lp.token_logprobs[1:len(ids)] == pytest.approx([e.logprob for e in want], abs=1e-4)
    raw = httpx.post(server.url("/v1/chat/completions"), timeout=60, json={
        "messages": _chat("Hi"), "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1}).json()
    plp = raw["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == raw["usage"]["prompt_tokens"]
    assert all(1 <= len(d) <= 2 and all("logprob" in v and "decoded_token" in v for v in d.values()) for d in plp[1:])


def test_tokenize_counts_what_generation_bills_and_detokenize_inverts_it(server, client):
    msgs = _chat(QUESTIONS[1])
    r = httpx.post(server.url("/tokenize"), json={"model": MODEL, "messages": msgs}, timeout=60).json()
    usage = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=1).usage
    assert r["count"] == len(r["tokens"]) == usage.prompt_tokens and r["max_model_len"] == 8192
    text = "The capital of France is"
    t = httpx.post(server.url("/tokenize"), json={"prompt": text, "return_token_strs": True}, timeout=60).json()
    cmpl = client.completions.create(model=MODEL, prompt=text, max_tokens=1, temperature=0)
    assert t["count"] == cmpl.usage.prompt_tokens and len(t["token_strs"]) == t["count"]
    back = httpx.post(server.url("/detokenize"), json={"tokens": t["tokens"]}, timeout=60).json()
    assert back == {"prompt": text}
    chat_text = httpx.post(server.url("/detokenize"), json={"tokens": r["tokens"]}, timeout=60).json()["prompt"]
    assert "<|im_start|>" in chat_text and QUESTIONS[1] in chat_text


def test_max_completion_tokens_and_length_finish(client):
    r = client.chat.completions.create(model=MODEL, messages=_chat(QUESTIONS[2]), temperature=0,
                                       max_completion_tokens=3)
    assert r.usage.completion_tokens == 3
    assert r.choices[0].finish_reason == "length"


# ---- concurrency ---------------------------------------------------------------------------------


def _concurrent_questions(n: int) -> list[str]:
    topics = ["rivers", "mountains", "bread", "music", "chess", "rain", "bees", "glass"]
    styles = ["Describe", "Give one fact about", "Why do people like", "Write a sentence about"]
    return [f"{styles[i % 4]} {topics[i % 8]}{' please' * (i // 8)}." for i in range(n)]


def test_32_concurrent_streams_match_alone(server, offline):
    questions = _concurrent_questions(32)
    max_tokens = 16
    # Alone: each prompt as the only request in the offline engine.
    alone = [offline.chat([_chat(q)], _greedy(max_tokens))[0] for q in questions]

    async def one(client: openai.AsyncOpenAI, q: str) -> tuple[str, int, str]:
        stream = await client.chat.completions.create(
            model=MODEL, messages=_chat(q), temperature=0, max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True})
        text, tokens, finish = [], -1, ""
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            for c in chunk.choices:
                text.append(c.delta.content or "")
                finish = c.finish_reason or finish
        return "".join(text), tokens, finish

    async def run_all() -> list[tuple[str, int, str]]:
        async with openai.AsyncOpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0,
                                      timeout=600) as client:
            return await asyncio.gather(*(one(client, q) for q in questions))

    results = asyncio.run(run_all())
    for q, exp, (text, tokens, finish) in zip(questions, alone, results):
        assert (text, tokens, finish) == (exp.text, len(exp.token_ids), exp.finish_reason), q


# ---- bad inputs ----------------------------------------------------------------------------------

_CHAT = "/v1/chat/completions"
_CMPL = "/v1/completions"
_OK_MSGS = [{"role": "user", "content": "hi"}]

BAD_INPUTS = [
    # (id, path, body (dict or raw bytes), status, code, param, message fragment)
    ("malformed-json", _CHAT, b'{"messages": [', 400, "invalid_json", None, "not valid JSON"),
    ("body-not-object", _CHAT, b"[1, 2]", 400, "invalid_request", None, "JSON object"),
    ("missing-messages", _CHAT, {"model": MODEL}, 400, "invalid_request", "messages", "missing"),
    ("empty-messages", _CHAT, {"messages": []}, 400, "invalid_request", "messages", None),
    ("bad-role", _CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400, "invalid_request",
     "messages.0.role", None),
    ("image-part", _CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "unsupported_parameter", "messages.0.content", "image_url"),
    ("temperature-range", _CHAT, {"messages": _OK_MSGS, "temperature": 5}, 400, "invalid_request",
     "temperature", "temperature"),
    ("temperature-type", _CHAT, {"messages": _OK_MSGS, "temperature": "hot"}, 400, "invalid_request",
     "temperature", None),
    ("top-p-zero", _CHAT, {"messages": _OK_MSGS, "top_p": 0}, 400, "invalid_request", "top_p", "top_p"),
    ("n-zero", _CHAT, {"messages": _OK_MSGS, "n": 0}, 400, "invalid_request", "n", None),
    ("n-huge", _CHAT, {"messages": _OK_MSGS, "n": 100000}, 400, "invalid_request", "n", None),
    ("max-tokens-zero", _CHAT, {"messages": _OK_MSGS, "max_tokens": 0}, 400, "invalid_request",
     "max_tokens", None),
    ("max-tokens-beyond-context", _CHAT, {"messages": _OK_MSGS, "max_tokens": 100000}, 400,
     "context_length_exceeded", None, "8192"),
    ("prompt-beyond-context", _CMPL, {"prompt": [1] * 8200, "max_tokens": 1}, 400,
     "context_length_exceeded", None, "8192"),
    ("prompt-plus-max-tokens", _CMPL, {"prompt": [1] * 8000, "max_tokens": 500}, 400,
     "context_length_exceeded", None, "8192"),
    ("token-id-out-of-vocab", _CMPL, {"prompt": [10**7], "max_tokens": 1}, 400, "invalid_request", None,
     "49152"),
    ("empty-prompt", _CMPL, {"prompt": "", "max_tokens": 1}, 400, "invalid_request", "prompt", "empty"),
    ("missing-prompt", _CMPL, {"max_tokens": 1}, 400, "invalid_request", "prompt", "missing"),
    ("echo-logprobs-stream", _CMPL, {"prompt": "x", "echo": True, "logprobs": 1, "stream": True}, 400,
     "unsupported_parameter", "echo", "without streaming"),
    ("logprobs-too-many", _CMPL, {"prompt": "x", "logprobs": 50}, 400, "invalid_request", "logprobs", None),
    ("top-logprobs-without-logprobs", _CHAT, {"messages": _OK_MSGS, "top_logprobs": 2}, 400,
     "invalid_request", "top_logprobs", None),
    ("presence-penalty-range", _CHAT, {"messages": _OK_MSGS, "presence_penalty": 2.5}, 400,
     "invalid_request", "presence_penalty", "[-2, 2]"),
    ("logit-bias-out-of-vocab", _CHAT, {"messages": _OK_MSGS, "logit_bias": {"60000": 1}}, 400,
     "invalid_request", None, "49152"),
    ("tools", _CHAT, {"messages": _OK_MSGS, "tools": [{"type": "function"}]}, 400,
     "invalid_request", "tools.0", None),
    ("tool-choice-unknown", _CHAT, {"messages": _OK_MSGS, "tools": [_WEATHER],
                                    "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400,
     "invalid_request", "tool_choice", "not in tools"),
    ("too-many-stops", _CHAT, {"messages": _OK_MSGS, "stop": ["a"] * 17}, 400, "invalid_request", "stop", None),
    ("empty-stop-string", _CHAT, {"messages": _OK_MSGS, "stop": [""]}, 400, "invalid_request", None, "stop"),
    ("stream-options-type", _CHAT, {"messages": _OK_MSGS, "stream_options": 3}, 400, "invalid_request",
     "stream_options", None),
    ("unknown-model", _CHAT, {"model": "gpt-nope", "messages": _OK_MSGS}, 404, "model_not_found", "model",
     "gpt-nope"),
    ("unknown-route", "/v1/embeddings", {"input": "x"}, 404, "not_found", None, None),
    ("tokenize-both-inputs", "/tokenize", {"prompt": "x", "messages": _OK_MSGS}, 400, "invalid_request", None,
     "exactly one"),
    ("tokenize-unknown-model", "/tokenize", {"model": "gpt-nope", "prompt": "x"}, 404, "model_not_found",
     "model", "gpt-nope"),
    ("detokenize-out-of-vocab", "/detokenize", {"tokens": [1, 10**6]}, 400, "invalid_request", "tokens", "49152"),
    ("invalid-json-schema", _CHAT, {"messages": _OK_MSGS, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/none"}}}}}}, 400,
     "invalid_request", "response_format.json_schema.schema", "cannot be compiled"),
    ("invalid-regex", _CMPL, {"prompt": "x", "guided_regex": "([a-z]"}, 400, "invalid_request", "guided_regex",
     "not a valid regular expression"),
    ("two-constraints", _CHAT, {"messages": _OK_MSGS, "guided_regex": "a", "guided_choice": ["b"]}, 400,
     "invalid_request", "guided_choice", "at most one"),
    ("detokenize-not-ids", "/detokenize", {"tokens": ["a"]}, 400, "invalid_request", None, "tokens"),
]


def _post(server, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(server.url(path), content=body, headers={"content-type": "application/json"}, timeout=60)
    return httpx.post(server.url(path), json=body, timeout=60)


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input(server, case):
    _, path, body, status, code, param, fragment = case
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code
    assert err["type"] == ("invalid_request_error" if status in (400, 404) else err["type"])
    if param is not None:
        assert err["param"] == param
    if fragment is not None:
        assert fragment in err["message"]


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-nope", messages=_OK_MSGS)
    with pytest.raises(openai.BadRequestError, match="8192"):
        client.completions.create(model=MODEL, prompt="hello", max_tokens=9000)


def test_bad_inputs_do_not_disturb_inflight_requests(server, offline):
    """Every bad input while a stream runs; the stream's text is unchanged and the server serves on."""
    exp = offline.chat([_chat(QUESTIONS[3])], _greedy(32))[0]
    got: dict[str, object] = {}

    def stream() -> None:
        c = openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=600)
        s = c.chat.completions.create(model=MODEL, messages=_chat(QUESTIONS[3]), temperature=0, max_tokens=32,
                                      stream=True)
        got["text"] = "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices)

    t = threading.Thread(target=stream)
    t.start()
    errors_before = sum(v for (n, _), v in server.metrics().items() if n == "kvmesh_request_errors_total")
    for case in BAD_INPUTS:
        assert _post(server, case[1], case[2]).status_code == case[3]
    t.join(600)
    assert got.get("text") == exp.text
    errors_after = sum(v for (n, _), v in server.metrics().items() if n == "kvmesh_request_errors_total")
    assert errors_after - errors_before == len(BAD_INPUTS)
    after = httpx.post(server.url(_CHAT), json={"messages": _chat(QUESTIONS[0]), "temperature": 0,
                                                "max_tokens": MAX_TOKENS}, timeout=600)
    assert after.status_code == 200
    assert after.json()["choices"][0]["message"]["content"] == offline.chat([_chat(QUESTIONS[0])], _greedy())[0].text


# ---- disconnects ----------------------------------------------------------------------------------


def _wait_idle_kv(server, idle_usage: float, timeout: float = 20.0) -> float:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        from kvmesh.engine.util.metrics import sample_value

        usage = sample_value(m, "kvmesh_kv_cache_usage_ratio")
        running = sample_value(m, "kvmesh_num_requests_running")
        waiting = sample_value(m, "kvmesh_num_requests_waiting")
        if usage == idle_usage and running == 0 and waiting == 0:
            return time.monotonic()
        if time.monotonic() > deadline:
            raise AssertionError(f"KV usage {usage} (idle {idle_usage}), running {running}, waiting {waiting}")
        time.sleep(0.05)


def test_disconnect_mid_stream_frees_kv(server):
    idle = server.metric("kvmesh_kv_cache_usage_ratio")
    aborted_before = server.metric("kvmesh_requests_finished_total", finish_reason="abort") or 0.0
    body = {"model": MODEL, "messages": _chat("Count from one to one thousand in words."), "max_tokens": 4000,
            "temperature": 0, "ignore_eos": True, "stream": True}
    n = 4
    clients = [httpx.Client(timeout=600) for _ in range(n)]
    streams = [c.stream("POST", server.url(_CHAT), json=body) for c in clients]
    # Keep each line iterator referenced: dropping one closes its connection early.
    line_iters = [s.__enter__().iter_lines() for s in streams]
    for it in line_iters:
        events = 0
        while events < 3:
            line = next(it)
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                events += 1
    assert server.metric("kvmesh_num_requests_running") == n
    assert server.metric("kvmesh_kv_cache_usage_ratio") > idle  # the streams hold blocks
    dropped = time.monotonic()
    for s, c in zip(streams, clients):
        s.__exit__(None, None, None)
        c.close()
    freed = _wait_idle_kv(server, idle)
    assert freed - dropped < 10.0
    aborted = server.metric("kvmesh_requests_finished_total", finish_reason="abort") - aborted_before
    assert aborted == n


def test_disconnect_of_non_streaming_request_frees_kv(server):
    idle = server.metric("kvmesh_kv_cache_usage_ratio")
    aborted_before = server.metric("kvmesh_requests_finished_total", finish_reason="abort") or 0.0
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url(_CMPL), json=body, timeout=httpx.Timeout(600, read=3.0))
    _wait_idle_kv(server, idle)
    assert server.metric("kvmesh_requests_finished_total", finish_reason="abort") - aborted_before == 1


# ---- metrics ---------------------------------------------------------------------------------------


def test_metrics_exposition(server):
    m = server.metrics()
    names = {n for n, _ in m}
    for required in [
        "kvmesh_time_to_first_token_seconds_bucket", "kvmesh_inter_token_latency_seconds_bucket",
        "kvmesh_time_per_output_token_seconds_bucket", "kvmesh_e2e_request_latency_seconds_bucket",
        "kvmesh_request_queue_time_seconds_bucket", "kvmesh_num_requests_running", "kvmesh_num_requests_waiting",
        "kvmesh_kv_cache_usage_ratio", "kvmesh_prompt_tokens_total", "kvmesh_generation_tokens_total",
        "kvmesh_prefix_cache_queries_total", "kvmesh_prefix_cache_hits_total", "kvmesh_preemptions_total",
        "kvmesh_requests_finished_total", "kvmesh_request_errors_total",
        "vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
        "vllm:cache_config_info",
    ]:
        assert required in names, required
    from kvmesh.engine.util.metrics import sample_value

    assert sample_value(m, "kvmesh_prefix_cache_hits_total") > 0
    assert sample_value(m, "kvmesh_generation_tokens_total") > 0
    assert sample_value(m, "kvmesh_time_to_first_token_seconds_count") > 0
    assert sample_value(m, "vllm:cache_config_info", block_size="16") == 1.0
