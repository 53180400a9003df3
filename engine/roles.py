"""What a request's role in a prefill/decode handoff is.

`LLMEngine.add_request` takes at most one `Handoff`: a `PrefillHandoff` (compute the prompt, then
hand its KV to a decode engine instead of generating) or a `DecodeClaim` (the prompt's KV and
first token arrived by transfer; start from there).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Union

ROLES = ("both", "prefill", "decode")
"""An engine server's role: both (colocated), or one side of prefill/decode handoffs."""


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
