"""This folder's shared fixtures: the tiny random Llama engine's (tests/support/tiny_engine.py) and
one tiny random hybrid model for the hybrid tests, written once per session (engines only read it)."""

import pytest

from tests.support.tiny_engine import loaded, model_dir  # noqa: F401 - pytest fixtures
from tests.support.tiny_hybrid import make_tiny_hybrid_model, two_turns


@pytest.fixture(scope="session")
def hybrid_dir(tmp_path_factory):
    return make_tiny_hybrid_model(tmp_path_factory.mktemp("hybrid"))


@pytest.fixture(scope="session")
def hybrid_turns(hybrid_dir):
    """(turn-1 tokens, turn-2 prompt, turn-2 tokens) of tiny_hybrid's two-turn conversation."""
    return two_turns(hybrid_dir)
