"""Grammar-constrained decoding in the engine (engine/structured).

Real: the engine on the tiny random Llama (every layer, the paged KV, the scheduler), its
byte-level BPE tokenizer and llguidance. The weights are random, so an unconstrained output is
noise: every valid output below is valid because of the grammar, in every engine mode.
"""

from __future__ import annotations

import json
import re

import pytest

from kvmesh.engine.sampling import SamplingParams
from kvmesh.engine.structured.grammar import InvalidGrammarError, StructuredOutput
from tests.support.tiny_engine import tiny_engine

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "n": {"type": "integer", "minimum": 0, "maximum": 999},
    "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3}},
    "required": ["name", "n", "tags"], "additionalProperties": False}
PROMPTS = [[5 + i, 6, 7 + 2 * i, 9] * (3 + i) for i in range(4)]


def _engine(model_dir, loaded, **cfg):
    cfg.setdefault("num_kv_blocks", 160)  # small: the per-step integrity checks are O(pool)
    return tiny_engine(model_dir, loaded, **cfg)


def _check(text: str) -> None:
    doc = json.loads(text)
    assert set(doc) == {"name", "n", "tags"}, text
    assert isinstance(doc["name"], str) and len(doc["name"]) <= 8
    assert isinstance(doc["n"], int) and 0 <= doc["n"] <= 999
    assert all(t in ("x", "y") for t in doc["tags"]) and len(doc["tags"]) <= 3
    assert " " not in text.replace(doc["name"], ""), "compact JSON has no free whitespace"


def _params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=80, structured=StructuredOutput.json_schema(SCHEMA, "response_format"), **kw)


@pytest.mark.parametrize("mode", [
    {}, {"max_num_batched_tokens": 8}, {"num_kv_blocks": 34, "enable_prefix_caching": False, "admission_reserve_tokens": 0}])
def test_json_schema_outputs_are_valid_in_every_mode(model_dir, loaded, mode):
    """Plain, chunked prefill (8-token chunks) and preemption (a pool too small for the batch):
    sampled at temperature 1, every output is a complete instance of the schema, ended by
    the grammar ("stop"); greedy tokens are the same in every mode."""
    llm = _engine(model_dir, loaded, **mode)
    for r in llm.generate(PROMPTS, _params(temperature=1.0, seed=3)):
        assert r.finish_reason == "stop", (r.finish_reason, r.text)
        _check(r.text)
    greedy = [r.token_ids for r in llm.generate(PROMPTS, _params(temperature=0.0))]
    plain = _engine(model_dir, loaded)
    assert greedy == [r.token_ids for r in plain.generate(PROMPTS, _params(temperature=0.0))]
    if "num_kv_blocks" in mode:
        assert llm.engine.stats().num_preemptions > 0


def test_prefix_hits_and_many_choices_stay_valid(model_dir, loaded):
    llm = _engine(model_dir, loaded)
    first = llm.generate([PROMPTS[0]] * 6, _params(temperature=1.0))
    again = llm.generate([PROMPTS[0]] * 6, _params(temperature=1.0))
    for r in first + again:
        _check(r.text)
    assert any(r.num_cached_tokens for r in again)
    assert len({r.text for r in first + again}) > 1, "independent samples differ"


@pytest.mark.parametrize("spec, ok", [
    (StructuredOutput.choice(["red", "green", "blue"], "guided_choice"), lambda t: t in ("red", "green", "blue")),
    (StructuredOutput("regex", r"[A-Z]{3}-[0-9]{2}", "guided_regex"), lambda t: re.fullmatch(r"[A-Z]{3}-[0-9]{2}", t)),
    (StructuredOutput("grammar", 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?', "guided_grammar"),
     lambda t: re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", t)),
    (StructuredOutput("json_object", "", "response_format"), lambda t: isinstance(json.loads(t), dict)),
])
def test_choice_regex_grammar_and_json_object(model_dir, loaded, spec, ok):
    llm = _engine(model_dir, loaded)
    for r in llm.generate(PROMPTS, SamplingParams(max_tokens=60, temperature=1.0, seed=1, structured=spec)):
        if r.finish_reason == "length":  # a grammar with unbounded repetition may run out of tokens
            assert spec.kind in ("grammar", "json_object")
            continue
        assert r.finish_reason == "stop" and ok(r.text), r.text


def test_max_tokens_inside_a_value_is_length(model_dir, loaded):
    llm = _engine(model_dir, loaded)
    r = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3, temperature=1.0,
                                                  structured=StructuredOutput.json_schema(SCHEMA, "x")))[0]
    assert r.finish_reason == "length" and r.text.startswith("{")


def test_with_logit_controls_and_a_banned_eos_the_grammar_still_wins(model_dir, loaded):
    """min_tokens masks EOS, the grammar may need it: the grammar's mask alone then decides."""
    llm = _engine(model_dir, loaded)
    spec = StructuredOutput.choice(["ok"], "guided_choice")
    r = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=20, temperature=0.0, min_tokens=10,
                                                  frequency_penalty=2.0, structured=spec))[0]
    assert r.text == "ok" and r.finish_reason == "stop"


@pytest.mark.parametrize("spec, param, text", [
    (StructuredOutput("json_schema", '{"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}', "guided_json"),
     "guided_json", "cannot be compiled"),
    (StructuredOutput("regex", "([a-z]", "guided_regex"), "guided_regex", "not a valid regular expression"),
    (StructuredOutput("grammar", "root ::= missing_rule", "guided_grammar"), "guided_grammar", "cannot be compiled"),
])
def test_bad_grammars_are_refused_at_the_door_naming_the_field(model_dir, loaded, spec, param, text):
    llm = _engine(model_dir, loaded)
    with pytest.raises(InvalidGrammarError) as e:
        llm.engine.add_request("bad", [1, 2, 3], SamplingParams(max_tokens=4, structured=spec))
    assert e.value.param == param and text in str(e.value)
    assert not llm.engine.has_unfinished_requests()


def test_a_matcher_catches_up_on_tokens_it_did_not_sample(model_dir, loaded):
    """A request that arrives by transfer holds the prefill engine's first token: the decode
    side's matcher consumes it before its first mask, so it continues from the prompt's end."""
    from kvmesh.engine.structured.masking import GrammarState

    llm = _engine(model_dir, loaded)
    spec = StructuredOutput.choice(["alpha", "beta"], "guided_choice")
    tok = llm.engine.tokenizer
    state = GrammarState(llm.engine.grammars.matcher(spec))
    first = tok.encode("alpha")[:1]
    state.catch_up(first)
    assert state.consumed == 1 and state.error is None
    wrong = GrammarState(llm.engine.grammars.matcher(spec))
    wrong.catch_up(tok.encode("zzz")[:1])
    assert wrong.error is not None


def test_any_schema_regex_or_grammar_compiles_or_is_an_invalid_grammar_error():
    """Fuzzed: whatever a client sends, the compiler answers with a matcher or InvalidGrammarError
    (a 400), never another exception and never a hang."""
    from hypothesis import given, settings, strategies as st

    from kvmesh.engine.structured.grammar import GrammarCompiler
    from tests.support.fuzz_json import SCHEMA as SCHEMAS
    from tests.support.tiny_models import TINY_VOCAB, make_tiny_tokenizer

    compiler = GrammarCompiler(make_tiny_tokenizer(), TINY_VOCAB, (0,))
    pieces = st.sampled_from(list('ab()[]{}|*+?.^$\\-:=" \n') + ["::=", "root ", "start: ", "[0-9]", '"x"'])
    texts = st.lists(pieces, max_size=12).map("".join)

    @settings(max_examples=200, deadline=None)
    @given(st.one_of(SCHEMAS.map(lambda s: StructuredOutput.json_schema(s, "guided_json")),
                     texts.map(lambda t: StructuredOutput("regex", t, "guided_regex")),
                     texts.map(lambda t: StructuredOutput("grammar", t, "guided_grammar"))))
    def check(spec):
        try:
            compiler.matcher(spec)
        except InvalidGrammarError as e:
            assert e.param == spec.param and str(e)

    check()


def test_masks_filled_ahead_are_the_masks_of_the_state_they_are_used_in(model_dir, loaded):
    """advance() fills the next step's masks ahead; start() takes a row from there only for the
    same state after the same number of tokens, and fills the rest (a new request, a state
    that moved on since): every mask equals one computed fresh from the matcher."""
    from types import SimpleNamespace

    import llguidance.torch
    import torch

    from kvmesh.engine.structured.masking import GrammarMasks, GrammarState

    llm = _engine(model_dir, loaded)
    spec = StructuredOutput.json_schema(SCHEMA, "response_format")
    vocab = llm.engine.model_config.vocab_size
    masks = GrammarMasks(vocab)

    def req(out=None):
        return SimpleNamespace(grammar=GrammarState(llm.engine.grammars.matcher(spec)), output_token_ids=out or [],
                               params=SamplingParams(max_tokens=50), handoff=None)

    def fresh(state):
        m = torch.full((1, masks.words), -1, dtype=torch.int32)
        llguidance.torch.fill_next_token_bitmask(state.matcher, m, 0)
        return m[0]

    def first_allowed(words):
        bits = ((words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab]
        return int(bits.nonzero()[0])

    reqs = [req(), req()]
    for step in range(6):
        if step == 3:
            reqs.append(req())                   # joins: nothing was filled ahead for it
        if step == 4:                            # moves on outside the step: the row ahead is stale
            masks._ahead.result()                # (the matcher is the worker's until its fill ends)
            t = first_allowed(fresh(reqs[0].grammar))
            reqs[0].output_token_ids.append(t)
        mask, rows = masks.start(reqs).result()
        assert rows == list(range(len(reqs)))
        for j, r in enumerate(reqs):
            r.grammar.catch_up(r.output_token_ids)
            assert torch.equal(mask[j], fresh(r.grammar)), (step, j)
        tokens = [first_allowed(mask[j]) for j in range(len(reqs))]
        masks.advance(reqs, tokens)
        for r, t in zip(reqs, tokens):
            r.output_token_ids.append(t)
    masks.close()


@pytest.mark.parametrize("native", [True, False])
def test_grammar_alone_masks_the_model_dtype_with_the_same_tokens(model_dir, loaded, monkeypatch, native):
    """Without logit controls the mask is applied to the model's logits (in place, or to a copy
    when logprobs need the raw ones): greedy tokens are those of the fp32 path that logit
    controls take (a zero logit bias on a token forces it), natively or by the torch unpack."""
    import kvmesh.engine.kernels.cpu_native as nat

    if not native:
        monkeypatch.setattr(nat, "apply_bitmask_cpu", lambda *a: False)
    llm = _engine(model_dir, loaded)
    plain = [r.token_ids for r in llm.generate(PROMPTS, _params(temperature=0.0))]
    with_lp = llm.generate(PROMPTS, _params(temperature=0.0, logprobs=1))
    fp32 = [r.token_ids for r in llm.generate(PROMPTS, _params(temperature=0.0, logit_bias={3: 0.0}))]
    assert plain == [r.token_ids for r in with_lp] == fp32
    assert all(lp.logprob > float("-inf") for r in with_lp for lp in r.logprobs)
