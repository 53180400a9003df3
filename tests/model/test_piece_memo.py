"""The piece memo gives exactly the backend's ids, and only where it can.

Real: Rust ``tokenizers`` backends (the tiny trained byte-level BPE with ChatML tokens, and the default
model's own tokenizer in the slow test), compared against their own ``encode``.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from kvmesh.engine.model.piece_memo import MIN_PIECE, PieceMemo
from kvmesh.engine.model.tokenizer import Tokenizer
from tests.support.tiny_models import make_tiny_tokenizer

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
LONG = ["You are a careful assistant. Answer briefly and cite the manual's section numbers. " * 3,
        "Réponds en français, s'il te plaît — 你好，世界 😀 " * 4, "  \n\n  leading and trailing spaces  \n" * 5]
_piece = st.one_of(st.sampled_from(SPECIALS), st.sampled_from(LONG), st.text(max_size=40),
                   st.sampled_from([" ", "\n", "system\n", "user\n", "<|im_", "|>", "<|im_start|"]))
texts = st.lists(_piece, max_size=12).map("".join)


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    return Tokenizer(make_tiny_tokenizer())


def backend_ids(tok: Tokenizer, text: str) -> list[int]:
    return tok._backend.encode(text, add_special_tokens=False).ids


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts)
def test_the_memo_gives_the_backends_ids(tiny, text):
    assert tiny._memo is not None
    assert tiny.encode(text) == backend_ids(tiny, text)
    assert tiny.encode(text) == backend_ids(tiny, text)  # again, from the memo


def test_a_repeated_system_prompt_is_tokenized_once(tiny):
    memo = tiny._memo
    before = memo._piece.cache_info()
    for i in range(5):
        text = f"<|im_start|>system\n{LONG[0]}<|im_end|>\n<|im_start|>user\nquestion {i}<|im_end|>\n"
        assert tiny.encode(text) == backend_ids(tiny, text)
    after = memo._piece.cache_info()
    assert after.hits - before.hits >= 4 and after.misses - before.misses <= 1


def test_no_memo_where_stretches_are_not_independent():
    from tokenizers import AddedToken, normalizers
    from tokenizers import Tokenizer as RustTokenizer

    with_normalizer = RustTokenizer.from_str(make_tiny_tokenizer().backend_tokenizer.to_str())
    with_normalizer.normalizer = normalizers.NFKC()
    assert PieceMemo.for_backend(with_normalizer) is None
    stripping = RustTokenizer.from_str(make_tiny_tokenizer().backend_tokenizer.to_str())
    stripping.add_special_tokens([AddedToken("<tool>", lstrip=True)])
    assert PieceMemo.for_backend(stripping) is None
    assert PieceMemo.for_backend(make_tiny_tokenizer().backend_tokenizer) is not None


def test_short_texts_skip_the_memo(tiny):
    before = tiny._memo._piece.cache_info()
    tiny.encode("x" * (MIN_PIECE - 1))
    assert tiny._memo._piece.cache_info() == before


@pytest.mark.slow  # loads the default model's tokenizer
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts)
def test_the_memo_gives_the_default_models_ids(smollm2, text):
    assert smollm2._memo is not None
    assert smollm2.encode(text) == backend_ids(smollm2, text)


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    from kvmesh.engine.model.fetch import ensure_default_model

    return Tokenizer.from_gguf(ensure_default_model(progress=False))
