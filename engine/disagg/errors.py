"""Why a decode engine refused or lost a transfer; each maps to one answer on the wire."""

from __future__ import annotations


class HandoffError(Exception):
    """Base of the decode side's refusals."""


class NoRoom(HandoffError):
    """Not enough free KV blocks right now; another decode engine (or a later try) may take it."""


class TooLarge(HandoffError):
    """The request needs more KV blocks than this engine has at all; no retry can help."""


class UnknownTransfer(HandoffError):
    """No reservation (or no completed transfer) under this id: it expired, was cancelled or never existed."""


class TransferMismatch(HandoffError):
    """What arrived does not belong to the reservation (other prompt, other hashes, out of order)."""


class BadField(HandoffError):
    """A message field the decode engine cannot accept (outside its vocabulary, context or sizes)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
