"""Control messages of the KV block protocol (msgpack, tagged), exchanged request/reply per connection.

One connection carries one request at a time. The exchanges (C: client, S: server)::

    put     C: PutOffer(batch)  S: PutWant(want)   C: payload of each wanted block   S: PutDone(statuses)
    lookup  C: Lookup(hashes)   S: LookupReply(length)
    get     C: Get(layout, hashes)  S: GetReply(batch)   S: payload of each block in batch
    stats   C: Stats()          S: StatsReply(stats)
    reserve C: Reserve(id, layout, prompt, max_tokens)   S: Reserved(...) | ErrorReply(no_room|too_large)
    push    C: PushKV(id, start, hashes, final, first, state)   S: PushReady()
            C: payload of each block (then the state's)         S: PushDone(num_payloads)
    cancel  C: Cancel(id)       S: Cancelled()
    lane    C: ShmOffer(name, nonce)   S: ShmAccept(nonce) | ShmDecline(reason)

A connection whose lane was accepted (same host: ``shm_lane``) carries every payload above as
chunks in its shared-memory slots, signalled on the lane's own socket, instead of UCX tag messages.

reserve/push/cancel are the prefill -> decode handoff (``engine.disagg``): the decode engine
reserves every block the request will need before it accepts any bytes, and checks the pushed
hashes against its own chain of the same prompt before it reads a payload.

Any request may instead be answered with ``ErrorReply`` (then no payload follows). The two-phase
put lets a server skip blocks it already holds or is receiving from another client: write-through
of a shared prefix costs one round trip, not its bytes. A get answers the longest prefix of the
asked chain that the server holds and that matches the asked layout (possibly empty).
"""

from __future__ import annotations

from typing import Any

import msgspec

from .header import BlockBatch, BlockLayout

PROTOCOL_VERSION = 2
"""2: a batch's payloads travel as chunks of a few MiB (ucx_payloads), not a message per block."""

# Per-block outcomes of a put.
STORED = "stored"
"""Received and stored by this put."""
EXISTS = "exists"
"""Already held (or being received from another put): nothing sent, nothing to do."""
TOO_LARGE = "too_large"
"""The block alone exceeds the server's whole budget; refused."""
NO_ROOM = "no_room"
"""The server could not reserve room right now (everything else is in flight); retry later or drop."""
PUT_STATUSES = (STORED, EXISTS, TOO_LARGE, NO_ROOM)

# ErrorReply kinds.
ERR_HEADER = "header_mismatch"
ERR_BAD_REQUEST = "bad_request"
ERR_INTERNAL = "internal"
ERR_NO_ROOM = "no_room"
"""A decode engine cannot hold the request now (retry elsewhere or later)."""
ERR_TOO_LARGE = "too_large"
"""A decode engine can never hold the request (its whole KV cache is too small)."""
ERR_UNKNOWN_TRANSFER = "unknown_transfer"
ERR_UNAUTHORIZED = "unauthorized"
"""The connection did not prove the deployment's internal token (transfer/auth.py); it is closed."""


class Message(msgspec.Struct, tag=True, array_like=True, frozen=True):
    pass


class PutOffer(Message, tag="put"):
    batch: BlockBatch


class PutWant(Message, tag="put_want"):
    want: list[bool]


class PutDone(Message, tag="put_done"):
    statuses: list[str]


class Lookup(Message, tag="lookup"):
    hashes: list[bytes]


class LookupReply(Message, tag="lookup_reply"):
    length: int


class Get(Message, tag="get"):
    layout: BlockLayout
    hashes: list[bytes]


class GetReply(Message, tag="get_reply"):
    batch: BlockBatch | None
    """None when not even the first block is held (a miss, not an error)."""


class Stats(Message, tag="stats"):
    pass


class StatsReply(Message, tag="stats_reply"):
    stats: dict[str, Any]


class ErrorReply(Message, tag="error"):
    kind: str
    message: str
    field: str | None = None
    expected: str | None = None
    got: str | None = None


class FirstToken(msgspec.Struct, frozen=True, array_like=True):
    """The token the prefill engine sampled from the prompt's last position, and what came with it.

    ``generator_state`` is the request's own RNG state after that draw (seeded sampling only), so
    the decode engine continues the exact random stream; ``cached_tokens`` are the prompt tokens
    the prefill engine (and tiers below it) served from cache, reported in the usage.
    """

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = []
    generator_state: bytes | None = None
    cached_tokens: int = 0


class Reserve(Message, tag="reserve"):
    transfer_id: str
    layout: BlockLayout
    prompt_token_ids: list[int]
    max_tokens: int
    chain_root: bytes = b""
    """The request's block chain root when it has a cache_salt (32 bytes); empty: ``ROOT_HASH``."""
    state: BlockLayout | None = None
    """Hybrid models: the layout (kind ``state``) of the recurrent state the final push carries;
    the decode engine checks it against its own model at reservation, like ``layout``."""


class Reserved(Message, tag="reserved"):
    hit_blocks: int
    """Leading prompt blocks the decode engine already holds: the prefill side sends from here."""
    num_blocks: int
    """Blocks reserved for the whole request (prompt plus max_tokens)."""


class PushKV(Message, tag="push"):
    """Blocks ``[start, start + len(hashes))`` of the prompt; the tail block's hash is None when
    partial. ``final`` closes the transfer and carries ``first``; with ``state`` (a hybrid model's
    final push only) one more payload follows the blocks: the request's recurrent state at the
    prompt's end, in the reservation's state layout. ``PushDone`` counts that payload too."""

    transfer_id: str
    start: int
    hashes: list[bytes | None]
    final: bool = False
    first: FirstToken | None = None
    state: bool = False


class PushReady(Message, tag="push_ready"):
    pass


class PushDone(Message, tag="push_done"):
    num_blocks: int


class Cancel(Message, tag="cancel"):
    transfer_id: str


class Cancelled(Message, tag="cancelled"):
    pass


class Hello(Message, tag="hello"):
    """First message on a connection, both ways: protocol version check before any request.
    ``nonce``/``proof``: the token handshake of transfer/auth.py (empty when the server has none)."""

    version: int
    role: str = ""
    nonce: bytes = b""
    proof: bytes = b""


class ShmOffer(Message, tag="shm_offer"):
    """The client's same-host lane (transfer/shm_lane.py): the name of the unix socket in /dev/shm
    that hands over its memfd, and the nonce written at the memfd's start."""

    name: str
    nonce: bytes
    chunk_bytes: int


class ShmAccept(Message, tag="shm_accept"):
    """The server took the lane; its memfd (handed over on the offer's socket) holds ``nonce``."""

    nonce: bytes


class ShmDecline(Message, tag="shm_decline"):
    """No lane: payloads keep going over UCX (another host, no room, or lanes off)."""

    reason: str


class Auth(Message, tag="auth"):
    """The client's proof of the internal token (transfer/auth.py), right after the Hellos."""

    proof: bytes


class AuthOk(Message, tag="auth_ok"):
    pass


AnyMessage = (PutOffer | PutWant | PutDone | Lookup | LookupReply | Get | GetReply | Stats | StatsReply | ErrorReply
              | Hello | Auth | AuthOk | ShmOffer | ShmAccept | ShmDecline
              | Reserve | Reserved | PushKV | PushReady | PushDone | Cancel | Cancelled)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyMessage)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(raw: bytes | memoryview) -> Message:
    """Raises ``msgspec.DecodeError`` or ``msgspec.ValidationError`` on anything malformed."""
    return _decoder.decode(raw)
