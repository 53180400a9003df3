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
    tail_tokens: int = 0
    """With ``stream``: a chunk that would end the prompt stops at a block boundary ``tail_tokens``
    or more before its end when at least ``tail_tokens`` come before that boundary
    (engine/scheduler.py ``chunk_tokens``), so the part pushed after the first token is that
    small; 0 leaves chunks as the budget cuts them."""

    def __post_init__(self) -> None:
        if self.from_block < 0:
            raise ValueError(f"PrefillHandoff.from_block must be >= 0, not {self.from_block}")
        if self.tail_tokens < 0:
            raise ValueError(f"PrefillHandoff.tail_tokens must be >= 0, not {self.tail_tokens}")


@dataclass(frozen=True)
class DecodeClaim:
    """Decode role: the prompt's KV and first token arrived under ``transfer_id``; ``claimed``
    resolves with the reservation when the engine took it over, or fails with
    ``UnknownTransfer``/``TransferMismatch`` (and the request ends with an "abort" output)."""

    transfer_id: str
    claimed: Future | None = None


Handoff = Union[PrefillHandoff, DecodeClaim]
