"""The commands other threads queue for the engine's step thread.

The step thread is the one owner of the KV pool and the scheduler; every other thread reaches
them only through a `StepCommand`, run in arrival order at the next step or idle tick.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Union

from kvmesh.engine.request import Request
from kvmesh.engine.roles import DecodeClaim


@dataclass(frozen=True)
class Add:
    request: Request


@dataclass(frozen=True)
class Claim:
    request: Request
    claim: DecodeClaim


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Call:
    """Run ``fn`` on the step thread; ``future`` gets its result or exception (never the step's)."""

    fn: Callable[[], Any]
    future: Future


StepCommand = Union[Add, Claim, Abort, Call]
