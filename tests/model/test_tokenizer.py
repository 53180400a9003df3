"""Tokenizer wrapper, chat templates, the streaming detokenizer and stop strings."""

from __future__ import annotations

import json
import random

import pytest

from kvmesh.engine.model.tokenizer import (
    ChatTemplateError,
    IncrementalDetokenizer,
    StopChecker,
    Tokenizer,
    TokenizerLoadError,
)

from tests.support.tiny_models import CHATML_TEMPLATE, make_tiny_hf_model, make_tiny_tokenizer

MIXED_TEXT = "Hello 😀 世界! Naïve café — 你好，世界。こんにちは 🇫🇷 done."
# Characters the tiny tokenizer never saw in training: each spans several byte tokens.
RARE_TEXT = "Hello 🚀 한국어 𝔘 Ελληνικά 世界 😀 done."


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    return Tokenizer(make_tiny_tokenizer())


def _spm_like_tokenizer() -> Tokenizer:
    """A Llama-2-style vocabulary: '▁' word marker, byte-fallback tokens, and a decoder stripping the first space."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for word in ["▁Hello", "▁world", "Hello", "!", "▁", "▁the", "re", "▁a", "b", ".", "▁▁"]:
        vocab[word] = len(vocab)
    rust = RustTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    rust.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    hf = PreTrainedTokenizerFast(tokenizer_object=rust, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    return Tokenizer(hf)


# ---- Tokenizer -----------------------------------------------------------------------------------------------------


def test_encode_decode_roundtrip(tiny):
    ids = tiny.encode(MIXED_TEXT)
    assert tiny.decode(ids) == MIXED_TEXT
    assert tiny.vocab_size == 1000 and tiny.bos_token_id == 1 and tiny.eos_token_ids == (2,)
    assert tiny.decode([1, *ids, 2], skip_special_tokens=True) == MIXED_TEXT
    assert tiny.decode([1, *ids, 2], skip_special_tokens=False) == f"<|im_start|>{MIXED_TEXT}<|im_end|>"


def test_chat_template_renders_and_tokenizes(tiny):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [
        {"type": "text", "text": "Capital of "}, {"type": "text", "text": "France?"}]}]
    text = tiny.chat_prompt_text(msgs)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCapital of France?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = tiny.apply_chat_template(msgs)
    assert ids == tiny.encode(text) and ids[0] == 1 and ids.count(2) == 2  # template specials become special ids
    assert tiny.chat_prompt_text(msgs, add_generation_prompt=False).endswith("France?<|im_end|>\n")


@pytest.mark.parametrize(
    "messages,match",
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        (["hi"], "message 0 must be an object"),
        ([{"role": "wizard", "content": "x"}], "role must be one of"),
        ([{"role": "user"}], "has no 'content'"),
        ([{"role": "user", "content": 42}], "content must be a string"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "content parts"),
    ],
)
def test_malformed_messages_raise(tiny, messages, match):
    with pytest.raises(ChatTemplateError, match=match):
        tiny.apply_chat_template(messages)


def test_missing_or_rejecting_template_raises():
    hf = make_tiny_tokenizer()
    hf.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer(hf).apply_chat_template([{"role": "user", "content": "hi"}])
    hf.chat_template = "{{ raise_exception('roles must alternate user/assistant') }}"
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        Tokenizer(hf).chat_prompt_text([{"role": "user", "content": "hi"}])


def test_from_dir_merges_generation_eos(tmp_path):
    d = make_tiny_hf_model("llama", tmp_path)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_dir(d, extra_eos_ids=[7, 2])
    assert tok.eos_token_ids == (2, 0, 7)
    assert tok.chat_prompt_text([{"role": "user", "content": "x"}]) == \
        "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(TokenizerLoadError, match="holds no tokenizer"):
        Tokenizer.from_dir(tmp_path)
    assert "message['role']" in CHATML_TEMPLATE


# ---- IncrementalDetokenizer ----------------------------------------------------------------------------------------


def _stream(tok: Tokenizer, ids: list[int], rng: random.Random, skip: bool = True) -> list[str]:
    """Feed `ids` in random-sized chunks; check at every step that emitted text is final text's prefix."""
    final = tok.decode(ids, skip_special_tokens=skip)
    d = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    deltas, i = [], 0
    while i < len(ids):
        k = rng.choice([1, 1, 1, 2, 3])
        deltas.append(d.add(ids[i:i + k]))
        i += k
        # Never emit a character that later changes (e.g. a U+FFFD that a later byte completes).
        assert final.startswith(d.text), (ids, d.text, final)
    deltas.append(d.finish())
    assert "".join(deltas) == final == d.text
    return deltas


@pytest.mark.parametrize("skip", [True, False])
def test_detokenizer_random_sequences(tiny, skip):
    rng = random.Random(1)
    for _ in range(300):
        ids = [rng.randrange(tiny.vocab_size) for _ in range(rng.randrange(1, 40))]
        _stream(tiny, ids, rng, skip)


@pytest.mark.parametrize("text", [MIXED_TEXT, RARE_TEXT])
def test_detokenizer_emoji_and_cjk_never_splits_characters(tiny, text):
    ids = tiny.encode(text)
    d = IncrementalDetokenizer(tiny)
    deltas = [d.add([i]) for i in ids] + [d.finish()]
    assert "".join(deltas) == text
    assert not any("\ufffd" in x for x in deltas)
    if text == RARE_TEXT:
        assert any("\ufffd" in tiny.decode([i]) for i in ids), "the text must contain multi-token characters"
        assert deltas.count("") >= 10  # tokens carrying only part of a character were held back


def test_detokenizer_sentencepiece_style_spaces_and_byte_fallback():
    tok = _spm_like_tokenizer()
    v = tok.hf.get_vocab()
    hello, world, bang = v["▁Hello"], v["▁world"], v["!"]
    zh = [v[f"<0x{b:02X}>"] for b in "中".encode()]
    ids = [hello, world, bang, *zh, world, 1, hello]
    d = IncrementalDetokenizer(tok)
    deltas = [d.add([i]) for i in ids] + [d.finish()]
    assert deltas[:3] == ["Hello", " world", "!"]
    assert tok.byte_fallback_ids and len(tok.byte_fallback_ids) == 256
    # A byte-fallback run is decoded as a unit, so its text is released when the run ends.
    assert deltas[3:7] == ["", "", "", "中 world"]
    assert "".join(deltas) == tok.decode(ids) == "Hello world!中 world Hello"
    rng = random.Random(2)
    for _ in range(300):
        seq = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))]
        _stream(tok, seq, rng, skip=rng.random() < 0.5)


def test_detokenizer_unfinished_character_is_flushed_at_the_end(tiny):
    ids = tiny.encode("ok 🚀")
    d = IncrementalDetokenizer(tiny)
    streamed = "".join(d.add([i]) for i in ids[:-1])
    assert "\ufffd" not in streamed
    tail = d.finish()
    assert streamed + tail == tiny.decode(ids[:-1]) and tail.endswith("\ufffd")


def test_detokenizer_decodes_a_bounded_window(tiny):
    """Work per token stays constant: the decoded window never grows with the output length."""

    class Counting(Tokenizer):
        def __init__(self, inner: Tokenizer) -> None:
            super().__init__(inner.hf)
            self.windows: list[int] = []

        def decode(self, ids, skip_special_tokens=True):
            self.windows.append(len(ids))
            return super().decode(ids, skip_special_tokens)

    tok = Counting(tiny)
    ids = tok.encode(" ".join([MIXED_TEXT] * 60))
    d = IncrementalDetokenizer(tok)
    for i in ids:
        d.add([i])
    assert len(ids) > 1000 and d.text + d.finish() == tok.decode(ids)
    assert max(tok.windows[:-1]) <= 8


# ---- StopChecker ---------------------------------------------------------------------------------------------------


def test_stop_check_finds_earliest_and_cross_delta_matches():
    sc = StopChecker(["END", "\n\n", "", "END"])
    assert sc.stops == ("END", "\n\n") and sc.max_len == 3
    assert sc.check("hello", 5) is None
    m = sc.check("hello E" + "ND more", 7)  # "E" came earlier, "ND more" is the new delta
    assert (m.stop, m.index, m.text) == ("END", 6, "hello ")
    m = sc.check("a\n\nb END", 8)
    assert (m.stop, m.text) == ("\n\n", "a")
    assert sc.check("xx", 0) is None and StopChecker([]).check("END", 3) is None


def test_stop_check_searches_only_the_tail():
    sc = StopChecker(["stop"])
    text = "stop" + "x" * 100  # an old occurrence, already handled by an earlier call
    assert sc.check(text, 10) is None
    assert sc.check(text + "sto", 3) is None
    assert sc.check(text + "stop", 1).index == 104


def test_holdback_is_longest_partial_stop_suffix():
    sc = StopChecker(["</s>", "###", "ab"])
    assert sc.holdback("hello") == 0
    assert sc.holdback("hello <") == 1
    assert sc.holdback("hello </") == 2
    assert sc.holdback("hello </s") == 3
    assert sc.holdback("x##") == 2
    assert sc.holdback("a") == 1 and sc.holdback("") == 0
    assert sc.holdback("xa") == 1 and sc.holdback("ab") == 0  # a complete stop is check()'s business


def test_streaming_with_holdback_never_leaks_a_stop_string():
    """Simulate a server: stream text[:len - holdback] after each delta, stop at the first match."""
    rng = random.Random(3)
    alphabet = "ab \n</>"
    for _ in range(2000):
        stops = ["".join(rng.choices(alphabet, k=rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        full = "".join(rng.choices(alphabet, k=rng.randint(0, 40)))
        sc = StopChecker(stops)
        text, sent, i = "", "", 0
        final = None
        expected = full
        while i < len(full):
            k = rng.randint(1, 5)
            delta = full[i:i + k]
            i += k
            # Reference: generation halts at the first delta after which some stop string is complete;
            # the output is cut at the earliest start among the stop strings present by then.
            starts = [j for j in (full[:i].find(s) for s in stops) if j >= 0]
            if starts and expected is full:
                expected = full[: min(starts)]
            text += delta
            match = sc.check(text, len(delta))
            if match:
                final = match.text
                break
            visible = text[: len(text) - sc.holdback(text)]
            assert visible.startswith(sent)
            sent = visible
        if final is None:
            final = text
        assert final == expected
        assert final.startswith(sent)  # nothing sent that the final output does not contain
        assert not any(s in sent for s in stops)


# ---- GGUF-embedded tokenizers --------------------------------------------------------------------------------------


def test_gguf_tokenizer_matches_and_is_cached(tmp_path, tiny):
    import os

    from tests.support.tiny_models import make_tiny_gguf

    _, gguf_path = make_tiny_gguf("llama", tmp_path)
    tok = Tokenizer.from_gguf(gguf_path)
    assert tok.encode(RARE_TEXT) == tiny.encode(RARE_TEXT)
    assert tok.decode(tiny.encode(RARE_TEXT)) == RARE_TEXT
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_ids) == (1000, 1, (2,))
    chat = tok.chat_prompt_text([{"role": "user", "content": "hi"}])
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    stamp = tmp_path / f".{gguf_path.name}.tokenizer" / "kvmesh-stamp.json"
    first = stamp.read_text()
    assert Tokenizer.from_gguf(gguf_path).encode("Paris") == tok.encode("Paris")
    st = gguf_path.stat()
    os.utime(gguf_path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a replaced file invalidates the cache
    assert Tokenizer.from_gguf(gguf_path).encode("Paris") == tok.encode("Paris")
    assert stamp.read_text() != first
    uncached = Tokenizer.from_gguf(gguf_path, cache=False)
    assert uncached.decode([1, 5], skip_special_tokens=False).startswith("<|im_start|>")


# ---- the real default model's tokenizer ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    from kvmesh.engine.model.fetch import ensure_default_model

    return Tokenizer.from_gguf(ensure_default_model(progress=False))


@pytest.mark.slow  # loads the default model's tokenizer and transformers'
def test_smollm2_chat_template_matches_transformers(smollm2):
    from transformers import AutoTokenizer

    from kvmesh.engine.model.fetch import ensure_default_model

    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    assert smollm2.chat_prompt_text(msgs) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    path = ensure_default_model(progress=False)
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert smollm2.apply_chat_template(msgs) == hf.apply_chat_template(msgs, add_generation_prompt=True)["input_ids"]
    with_system = [{"role": "system", "content": "Answer in French."}, *msgs]
    assert "SmolLM" not in smollm2.chat_prompt_text(with_system)
    assert (smollm2.vocab_size, smollm2.bos_token_id, smollm2.eos_token_ids) == (49152, 1, (2,))
    assert smollm2.encode(MIXED_TEXT) == hf.encode(MIXED_TEXT, add_special_tokens=False)


@pytest.mark.slow  # loads the default model's tokenizer and transformers'
def test_smollm2_detokenizer_streams_exactly(smollm2):
    rng = random.Random(4)
    for _ in range(200):
        ids = [rng.randrange(smollm2.vocab_size) for _ in range(rng.randrange(1, 50))]
        _stream(smollm2, ids, rng, skip=rng.random() < 0.5)
    for text in (MIXED_TEXT, RARE_TEXT):
        ids = smollm2.encode(text)
        d = IncrementalDetokenizer(smollm2)
        deltas = [d.add([i]) for i in ids] + [d.finish()]
        assert "".join(deltas) == text and not any("\ufffd" in x for x in deltas)
    # Work stays per token, not per output so far: every decode sees a short window.
    counting = _CountingDecodes(smollm2)
    d = IncrementalDetokenizer(counting)  # type: ignore[arg-type] - what the detokenizer uses of a Tokenizer
    ids = smollm2.encode(" ".join([RARE_TEXT] * 200))
    for i in ids:
        d.add([i])
    assert "".join([d.text, d.finish()]) == smollm2.decode(ids)
    assert max(counting.windows) <= 16 and sum(counting.windows) <= 8 * len(ids), (max(counting.windows),
                                                                                   sum(counting.windows), len(ids))


class _CountingDecodes:
    """A tokenizer that records how many ids each decode call is given."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.windows: list[int] = []
        self.byte_fallback_ids = tok.byte_fallback_ids
        self.special_token_ids = tok.special_token_ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        self.windows.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)
