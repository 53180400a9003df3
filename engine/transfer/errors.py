"""Exceptions of the KV block transport. Callers catch ``TransferError`` to fall back to recompute."""

from __future__ import annotations

from typing import Any


class TransferError(Exception):
    """Base of every transport failure; a cache miss is not one (lookups and gets report it)."""


class HeaderMismatch(TransferError):
    """A block header disagrees with what the receiver expects; the block is neither stored nor loaded.

    ``field`` names the first header field that differs (``version``, ``extra_key``, ``dtype``,
    ``block_size``, ``num_layers``, ``num_kv_heads``, ``head_dim``, ``buffers``, ``block_hash``,
    ``parent_hash``; for checkpoints ``kind``, ``state`` and ``state[<buffer>]``).
    """

    def __init__(self, field: str, expected: Any, got: Any, detail: str = "") -> None:
        self.field, self.expected, self.got = field, expected, got
        msg = (f"KV block header mismatch on {field!r}: expected {_short(expected)}, got {_short(got)}"
               + (f" ({detail})" if detail else "")
               + "; the block was rejected (check both sides run the same model, dtype and KV geometry)")
        super().__init__(msg)


class PeerGone(TransferError):
    """The peer closed or died while a request was in flight (connection reset, process killed)."""


class TransferTimeout(TransferError):
    """A request did not finish within its deadline; its connection was dropped, not reused."""


class ConnectFailed(TransferError):
    """No connection could be made to the peer (nothing listening, unreachable, handshake timeout)."""


class AuthFailed(TransferError):
    """The peer did not prove the deployment's internal token, or asked this side for one it does
    not hold (or holds one the peer does not check); the message says which side lacks what."""


class ProtocolError(TransferError):
    """The peer sent something this side cannot decode (version skew or a bug); the connection is dropped."""


class RemoteError(TransferError):
    """The peer understood the request but answered with an error (its message is included);
    ``kind`` is the answer's kind (``protocol.ERR_*``)."""

    def __init__(self, message: str, kind: str = "") -> None:
        super().__init__(message)
        self.kind = kind


def _short(value: Any) -> str:
    if isinstance(value, bytes):
        return value.hex()[:16] + ("..." if len(value) > 8 else "")
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


class LaneMismatch(PeerGone):
    """The peer took a same-host lane this side cannot open (an odd /dev/shm setup): the
    connection is dropped, and the client offers no lane again."""
