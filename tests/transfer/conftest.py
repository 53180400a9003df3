"""Fixtures of the transfer tests."""

from __future__ import annotations

import pytest

from kvmesh.engine.transfer.loop_thread import LoopThread


@pytest.fixture
def loop():
    """A transfer event loop on its own thread, as servers and clients run on; closed afterwards."""
    lt = LoopThread()
    yield lt
    lt.close()
