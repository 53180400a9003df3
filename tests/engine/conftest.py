"""The tiny random Llama engine's fixtures (tests/support/tiny_engine.py) for this folder."""

from tests.support.tiny_engine import loaded, model_dir  # noqa: F401 - pytest fixtures
