"""Fixtures of the operator's unit tests."""

from __future__ import annotations

import pytest

from tests.support.crs import make_cr


@pytest.fixture
def cr():
    return make_cr()
