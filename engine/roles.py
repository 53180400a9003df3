"""What a request's role in a prefill/decode handoff is, and the commands the step thread runs.

`LLMEngine.add_request` takes at most one `Handoff`: a `PrefillHandoff` (compute the prompt, then
hand its KV to a decode engine instead of generating) or a `DecodeClaim` (the prompt's KV and
first token arrived by transfer; start from there). Every other thread reaches the engine's
state only through a `StepCommand` queued for the step thread (the one owner of the KV pool),
run in arrival order at the next step or idle tick.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

if TYPE_CHECKING:
    from kvmesh.engine.request import Request


@dataclass(frozen=True)
class PrefillHandoff:
    """Prefill role: stop after the first token and hand over the KV of prompt blocks from
    ``from_block`` on (the blocks before it are already on the decode engine). With ``stream``,
    each step that completes prompt blocks outputs them at once as a partial handoff."""

    from_block: int = 0
    stream: bool = False

    def __post_init__(self) -> None:
        if self.from_block < 0:
            raise ValueError(f"PrefillHandoff.from_block must be >= 0, not {self.from_block}")


@dataclass(frozen=True)
class DecodeClaim:
    """Decode role: the prompt's KV and first token arrived under ``transfer_id``; ``claimed``
    resolves with the reservation when the engine took it over, or fails with
    ``UnknownTransfer``/``TransferMismatch`` (and the request ends with an "abort" output)."""

    transfer_id: str
    claimed: Future | None = None


Handoff = Union[PrefillHandoff, DecodeClaim]


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
