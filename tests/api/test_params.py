"""Request -> sampling parameters, errors and response helpers: pure functions."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from kvmesh.engine.outputs import TokenLogprob
from kvmesh.engine.api import errors, params
from kvmesh.engine.server import responses
from kvmesh.engine.api.errors import APIError
from kvmesh.engine.api.protocol import ChatCompletionRequest, CompletionRequest

LIMITS = params.Limits(max_model_len=100, kv_capacity_tokens=1000)


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw)


def test_derive_seed_keeps_choice_zero_and_separates_others():
    assert params.derive_seed(None, 3) is None
    assert params.derive_seed(42, 0) == 42
    seeds = [params.derive_seed(42, i) for i in range(1, 6)]
    assert len(set(seeds)) == 5 and 42 not in seeds
    assert seeds == [params.derive_seed(42, i) for i in range(1, 6)]  # deterministic
    assert params.derive_seed(43, 1) != params.derive_seed(42, 1)
    assert all(0 <= s < 2**63 for s in seeds)


@pytest.mark.parametrize("requested,default,prompt,expected", [
    (10, 16, 5, 10), (None, 16, 5, 16), (None, None, 30, 70), (95, None, 5, 95),
])
def test_resolve_max_tokens(requested, default, prompt, expected):
    assert params.resolve_max_tokens(requested, default, prompt, LIMITS) == expected


@pytest.mark.parametrize("requested,default,prompt", [(96, None, 5), (None, None, 100), (None, 16, 90)])
def test_resolve_max_tokens_beyond_context_names_the_limit(requested, default, prompt):
    with pytest.raises(APIError) as e:
        params.resolve_max_tokens(requested, default, prompt, LIMITS)
    assert e.value.status == 400 and e.value.code == "context_length_exceeded"
    assert "100 tokens" in e.value.message


def test_resolve_max_tokens_names_kv_capacity_when_it_is_the_bound():
    with pytest.raises(APIError, match="KV cache .* 50 tokens"):
        params.resolve_max_tokens(60, None, 1, params.Limits(max_model_len=100, kv_capacity_tokens=50))


def test_max_tokens_below_one_is_invalid():
    with pytest.raises(APIError) as e:
        params.resolve_max_tokens(0, 16, 1, LIMITS)
    assert e.value.param == "max_tokens"


def test_sampling_params_defaults_follow_openai():
    p = params.sampling_params(chat(), 10, None)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens, p.logprobs) == (1.0, 1.0, -1, 0.0, 10, None)
    p = params.sampling_params(chat(temperature=0, stop="x", seed=5, top_k=3, ignore_eos=True), 4, 2)
    assert (p.temperature, p.stop, p.seed, p.top_k, p.ignore_eos, p.logprobs) == (0.0, ["x"], 5, 3, True, 2)


@pytest.mark.parametrize("field,value", [("temperature", 3.0), ("top_p", 0.0), ("min_p", 2.0), ("top_k", -5)])
def test_sampling_params_range_errors_name_the_parameter(field, value):
    with pytest.raises(APIError) as e:
        params.sampling_params(chat(**{field: value}), 4, None)
    assert e.value.status == 400 and e.value.param == field


@pytest.mark.parametrize("kw,param", [
    ({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_chat_unsupported_or_inconsistent(kw, param):
    with pytest.raises(APIError) as e:
        params.check_chat_unsupported(chat(**kw))
    assert e.value.status == 400 and e.value.param == param


def test_text_format_is_accepted():
    params.check_chat_unsupported(chat(response_format={"type": "text"}))


def test_logit_controls_reach_the_engine_parameters():
    p = params.sampling_params(chat(presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.2,
                                    logit_bias={"7": -100, "12": 3.5}, min_tokens=2, allowed_token_ids=[1, 2]),
                               4, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -1, 1.2)
    assert (p.logit_bias, p.min_tokens, p.allowed_token_ids) == ({7: -100, 12: 3.5}, 2, [1, 2])
    assert params.sampling_params(chat(), 4, None).controls_logits is False


@pytest.mark.parametrize("kw,param,text", [
    ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
    ({"frequency_penalty": -3}, "frequency_penalty", "[-2, 2]"),
    ({"repetition_penalty": 0}, "repetition_penalty", "(0, 2]"),
    ({"logit_bias": {"x1": 2.0}}, "logit_bias", "token ids"),
    ({"logit_bias": {"3": 200}}, "logit_bias", "[-100, 100]"),
    ({"min_tokens": 5}, "min_tokens", "max_tokens (4)"),
])
def test_logit_controls_out_of_range_are_400s_with_the_range(kw, param, text):
    with pytest.raises(APIError) as e:
        params.sampling_params(chat(**kw), 4, None)
    assert e.value.status == 400 and e.value.param == param and text in e.value.message


@pytest.mark.parametrize("kw,param", [({"suffix": "x"}, "suffix"), ({"best_of": 3}, "best_of"),
                                      ({"echo": True, "logprobs": 1, "stream": True}, "echo")])
def test_completion_unsupported(kw, param):
    with pytest.raises(APIError) as e:
        params.check_completion_unsupported(CompletionRequest(prompt="x", **kw))
    assert e.value.param == param


def test_chat_logprobs_mapping():
    assert params.chat_logprobs(chat()) is None
    assert params.chat_logprobs(chat(logprobs=True)) == 0
    assert params.chat_logprobs(chat(logprobs=True, top_logprobs=4)) == 4


def test_chat_messages_flatten_text_parts_and_map_developer():
    req = ChatCompletionRequest(messages=[
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
    ])
    assert params.chat_messages(req.messages) == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"},
        {"role": "assistant", "content": ""}]
    bad = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "image_url"}]}])
    with pytest.raises(APIError, match="image_url"):
        params.chat_messages(bad.messages)


def test_expand_choices_is_prompt_major_with_derived_seeds():
    base = params.sampling_params(chat(seed=9, stop=["x"]), 4, None)
    specs = params.expand_choices(base, n=3, num_prompts=2)
    assert [(s.index, s.prompt_index) for s in specs] == [(0, 0), (1, 0), (2, 0), (3, 1), (4, 1), (5, 1)]
    assert [s.params.seed for s in specs[:3]] == [9, params.derive_seed(9, 1), params.derive_seed(9, 2)]
    assert len({id(s.params) for s in specs}) == 6 and len({id(s.params.stop) for s in specs}) == 6


def test_completion_prompt_shapes():
    assert CompletionRequest(prompt="a").prompts() == ["a"]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(prompt=[1, 2]).prompts() == [[1, 2]]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]
    with pytest.raises(ValidationError):
        CompletionRequest(prompt=[])


def test_validation_errors_become_openai_errors():
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "n": 0})
    err = errors.from_validation_errors(e.value.errors())
    assert (err.status, err.code, err.param) == (400, "invalid_request", "n")
    body = err.body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["type"] == "invalid_request_error"
    bad_json = errors.from_validation_errors([{"type": "json_invalid", "loc": ("body", 3), "msg": "x",
                                               "ctx": {"error": "Expecting value"}}])
    assert bad_json.code == "invalid_json" and "Expecting value" in bad_json.message


def test_status_errors_carry_retry_after():
    q = errors.queue_full(8, 3)
    assert (q.status, q.code, q.headers) == (429, "queue_full", {"Retry-After": "3"})
    s = errors.shutting_down()
    assert s.status == 503 and "Retry-After" in s.headers
    assert errors.model_not_found("x", ["m"]).status == 404


def test_sse_and_usage_helpers():
    assert responses.sse({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    assert responses.usage(5, 3, 2) == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                                        "prompt_tokens_details": {"cached_tokens": 2}}


def test_logprob_formats():
    text = {1: "a", 2: "bc", 3: "d"}.__getitem__
    entries = [TokenLogprob(1, -0.1, [(1, -0.1), (3, -2.0)]), TokenLogprob(2, -float("inf"), [(3, -0.5)])]
    body, end = responses.completion_logprobs(entries, text, 10, num_top=1)
    assert body["tokens"] == ["a", "bc"] and body["text_offset"] == [10, 11] and end == 13
    assert body["token_logprobs"] == [-0.1, -9999.0]
    assert body["top_logprobs"] == [{"a": -0.1}, {"d": -0.5, "bc": -9999.0}]
    chat_body = responses.chat_logprobs(entries, text)
    assert chat_body["content"][0] == {"token": "a", "logprob": -0.1, "bytes": [97], "top_logprobs": [
        {"token": "a", "logprob": -0.1, "bytes": [97]}, {"token": "d", "logprob": -2.0, "bytes": [100]}]}


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("kw, kind, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     "json_schema", "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
    ({"structured_outputs": {"json": SCHEMA}}, "json_schema", "structured_outputs.json"),
    ({"structured_outputs": {"regex": "[a-z]+"}}, "regex", "structured_outputs.regex"),
    ({"guided_json": json.dumps(SCHEMA)}, "json_schema", "guided_json"),
    ({"guided_choice": ["yes", "no"]}, "choice", "guided_choice"),
    ({"guided_regex": "a+"}, "regex", "guided_regex"),
    ({"guided_grammar": 'root ::= "a"'}, "grammar", "guided_grammar"),
])
def test_every_structured_output_field_becomes_one_constraint(kw, kind, param):
    spec = params.sampling_params(chat(**kw), 4, None).structured
    assert (spec.kind, spec.param) == (kind, param)
    if kind == "json_schema":
        assert json.loads(spec.value) == SCHEMA


def test_the_same_schema_is_one_cache_entry_whatever_its_key_order():
    a = params.structured_output(chat(guided_json={"type": "object", "required": ["a"]}))
    b = params.structured_output(chat(guided_json={"required": ["a"], "type": "object"}))
    assert a.cache_key() == b.cache_key()


@pytest.mark.parametrize("kw, param, text", [
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex", "at most one output constraint"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice", "at most one"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema", "needs json_schema.schema"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_json": "[1, 2]"}, "guided_json", "must be a JSON schema object"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_regex": ""}, "guided_regex", "non-empty string"),
    ({"response_format": {"type": "xml"}}, "response_format", "json_object and json_schema are served"),
])
def test_malformed_structured_outputs_are_400s_naming_the_field(kw, param, text):
    with pytest.raises(APIError) as e:
        req = chat(**kw)
        params.check_chat_unsupported(req)
        params.sampling_params(req, 4, None)
    assert e.value.status == 400 and e.value.param == param and text in e.value.message


def test_echo_with_logprobs_scores_the_prompt():
    p = params.sampling_params(CompletionRequest(prompt="x", echo=True, logprobs=3), 4, 3)
    assert p.prompt_logprobs == 3
    assert params.sampling_params(CompletionRequest(prompt="x", logprobs=3), 4, 3).prompt_logprobs is None
    assert params.sampling_params(chat(prompt_logprobs=0), 4, None).prompt_logprobs == 0
    with pytest.raises(APIError) as e:
        params.sampling_params(chat(prompt_logprobs=21), 4, None)
    assert e.value.param == "prompt_logprobs"


def _tiny_tokenizer():
    from kvmesh.engine.model.tokenizer import Tokenizer
    from tests.support.tiny_models import make_tiny_tokenizer

    return Tokenizer(make_tiny_tokenizer())


def _request_error(body: dict) -> APIError:
    """The 400 a chat body gets, from the protocol's checks or from sampling_params."""
    try:
        req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **body})
    except ValidationError as e:
        return errors.from_validation_errors(e.errors())
    with pytest.raises(APIError) as e:
        params.sampling_params(req, 4, None, _tiny_tokenizer())
    return e.value


@pytest.mark.parametrize("bad, param, text", [
    ("Paris", "bad_words", "list"),
    ([1], "bad_words.0", "string"),
    (["ok", ""], "bad_words", "not only whitespace"),
    ([" \n"], "bad_words", "not only whitespace"),
    (["w"] * 101, "bad_words", "at most 100"),
    (["x" * 101], "bad_words", "1 to 100 characters"),
    (["😀" * 20], "bad_words.0", "at most 32"),
])
def test_malformed_bad_words_are_400s_naming_the_field(bad, param, text):
    err = _request_error({"bad_words": bad})
    assert (err.status, err.param) == (400, param) and text in err.message, err.message


def test_bad_words_tokenize_at_the_start_and_after_a_space_as_vllm_does():
    tok = _tiny_tokenizer()
    seqs = params.bad_words_token_ids(tok, ["Paris", "  quick brown", "the"])
    expect = []
    for word in ("Paris", "quick brown", "the"):
        plain, spaced = tok.encode(word), tok.encode(" " + word)
        expect.append(plain)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            expect.append(spaced)
    assert seqs == expect and len(seqs) > 3, "some word is also banned after a space"
    p = params.sampling_params(chat(bad_words=["Paris"], n=2), 4, None, tok)
    assert p.bad_words_token_ids == seqs[:len(p.bad_words_token_ids)] and p.controls_logits
    copies = params.expand_choices(p, 2, 1)
    assert copies[1].params.bad_words_token_ids == p.bad_words_token_ids
    assert copies[1].params.bad_words_token_ids is not p.bad_words_token_ids
