"""A decode engine's KV transfer endpoint: a ucxx listener answering reserve, push and cancel.

Runs on its own transfer loop thread; every decision about blocks is the engine's (through its
``DecodeRole``, ``engine.decode``, whose calls run at the engine's next step or idle tick), so
this module only frames messages and moves bytes.

Failure semantics: a refused reservation is answered at once (``no_room``, ``too_large``,
``header_mismatch``) and the connection stays usable; a push whose hashes or position do not fit
the reservation is answered ``bad_request`` before any payload is read; a connection that drops
frees the incomplete reservations whose last message it carried (the prefill side is gone, or
that transfer failed); payloads that do not all arrive within ``payload_timeout_s`` drop the
connection, which frees the reservation the same way. A hybrid model's reservation must name the
engine's own recurrent-state layout (checked field by field, counted in ``header_mismatches``),
and its final push carries that state as one more payload after the blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..transfer import protocol
from ..transfer.auth import TokenSource, no_token
from ..transfer.channel import Channel
from ..transfer.errors import HeaderMismatch, TransferTimeout
from ..transfer.header import BlockLayout, check_layout
from ..transfer.loop_thread import shared_loop
from ..transfer.server import KVServer
from ..transfer.staging import StagingPool
from .checks import Limits, check_push, check_reserve, check_state_layout, check_transfer_id
from .errors import BadField, HandoffError, NoRoom, TooLarge, UnknownTransfer
from kvmesh.engine.kv.gather import block_shape, cache_layout
from kvmesh.engine.kv.slot_wire import slot_state_layout
from kvmesh.engine.block_hash import ROOT_HASH

log = logging.getLogger("kvmesh.disagg")


def _refusal(e: HandoffError) -> protocol.ErrorReply:
    kind = (protocol.ERR_NO_ROOM if isinstance(e, NoRoom) else protocol.ERR_TOO_LARGE if isinstance(e, TooLarge)
            else protocol.ERR_UNKNOWN_TRANSFER if isinstance(e, UnknownTransfer) else protocol.ERR_BAD_REQUEST)
    return protocol.ErrorReply(kind, str(e), e.field if isinstance(e, BadField) else None)


class DecodeHandler:
    """Answers the prefill side for one decode engine (shared by every connection)."""

    def __init__(self, engine: Any, *, payload_timeout_s: float = 60.0,
                 accepting: Callable[[], bool] = lambda: True) -> None:
        """``accepting`` is false while the server drains or stops: new reservations are refused."""
        self.engine = engine
        self.accepting = accepting
        self.layout: BlockLayout = cache_layout(engine.kv.extra, engine.runner.kv_cache)
        states = engine.runner.states
        self.state_layout: BlockLayout | None = (
            None if states is None else slot_state_layout(self.layout, states, engine.model_config.linear_layers))
        """A hybrid model's recurrent-state layout: every reservation must name exactly this one."""
        self.state_bytes = 0 if self.state_layout is None else self.state_layout.nbytes
        self.block_shape = block_shape(engine.runner.kv_cache)
        self.dtype = engine.runner.kv_cache.dtype
        self.payload_timeout_s = payload_timeout_s
        self.staging = StagingPool()
        """Where pushes land; each buffer comes back once its blocks are in the KV cache."""
        self.recycle = engine.runner.kv_cache.device.type == "cpu"
        """Only where the fill's copy is synchronous: on a GPU it may still read the buffer."""
        self.limits = Limits(engine.model_config.vocab_size, engine.max_model_len, engine.kv.num_total_blocks,
                             str(engine.device), state_bytes=self.state_bytes)
        self.blocks_received = 0
        self.bytes_received = 0
        self.header_mismatches = 0
        """Reservations refused because their KV or state layout differs from this engine's."""

    async def handle(self, msg: protocol.Message, ch: Channel) -> None:
        try:
            if isinstance(msg, protocol.Reserve):
                check_reserve(msg, self.limits)
            elif isinstance(msg, protocol.PushKV):
                check_push(msg, self.limits)
            elif isinstance(msg, protocol.Cancel):
                check_transfer_id(msg.transfer_id)
        except BadField as e:
            # Refused before anything is reserved, written or read: the connection stays usable.
            await ch.send(_refusal(e))
            return
        if isinstance(msg, protocol.Reserve):
            await self._reserve(msg, ch)
        elif isinstance(msg, protocol.PushKV):
            await self._push(msg, ch)
        elif isinstance(msg, protocol.Cancel):
            self.engine.decode.cancel(msg.transfer_id)
            await ch.send(protocol.Cancelled())
        else:
            await ch.send(protocol.ErrorReply(protocol.ERR_BAD_REQUEST,
                                              f"a decode engine does not answer {type(msg).__name__}"))

    def connection_closed(self, ch: Channel) -> None:
        self.engine.decode.drop_owner(ch)

    async def _reserve(self, msg: protocol.Reserve, ch: Channel) -> None:
        if not self.accepting():
            await ch.send(protocol.ErrorReply(protocol.ERR_NO_ROOM, "this decode engine is draining or stopping"))
            return
        try:
            check_layout(self.layout, msg.layout)
            check_state_layout(self.state_layout, msg.state)
        except HeaderMismatch as e:
            self.header_mismatches += 1
            await ch.send(protocol.ErrorReply(protocol.ERR_HEADER, str(e), e.field, repr(e.expected), repr(e.got)))
            return
        try:
            r = await asyncio.wrap_future(self.engine.decode.reserve(msg.transfer_id, msg.prompt_token_ids,
                                                                       msg.max_tokens, owner=ch,
                                                                       root=msg.chain_root or ROOT_HASH))
        except HandoffError as e:
            await ch.send(_refusal(e))
            return
        await ch.send(protocol.Reserved(r.hit_blocks, r.num_blocks))

    async def _push(self, msg: protocol.PushKV, ch: Channel) -> None:
        try:
            await asyncio.wrap_future(self.engine.decode.check_push(msg.transfer_id, msg.start, msg.hashes, msg.final,
                                                             owner=ch))
        except HandoffError as e:
            await ch.send(_refusal(e))
            return
        await ch.send(protocol.PushReady())
        n = len(msg.hashes)
        data = state = None
        # The state lands in memory of its own: it stays with the transfer until the claim (the
        # staging buffer goes back to the pool right after the fill).
        state_buf = np.empty(self.state_bytes, np.uint8) if msg.state else None
        if n or state_buf is not None:
            nbytes = self.layout.nbytes
            buf = self.staging.take(n * nbytes) if n else None
            into = [buf[i * nbytes:(i + 1) * nbytes] for i in range(n)] + ([state_buf] if state_buf is not None else [])
            try:
                await asyncio.wait_for(ch.recv_payloads_into(into), self.payload_timeout_s)
            except TimeoutError:
                raise TransferTimeout(f"push of {n} blocks for {msg.transfer_id} did not arrive within "
                                      f"{self.payload_timeout_s:.0f}s") from None
            if n:
                data = torch.from_numpy(buf).view(self.dtype).view(n, *self.block_shape)
            if state_buf is not None:
                state = torch.from_numpy(state_buf)
        filled = self.engine.decode.fill(msg.transfer_id, msg.start, data, msg.final, msg.first, state)
        try:
            await asyncio.wrap_future(filled)
        except HandoffError as e:
            await ch.send(_refusal(e))
            return
        finally:
            # Only once the step thread is done with the bytes (copied into the KV cache, or refused):
            # a fill still queued when this wait was cancelled keeps its buffer to itself.
            if n and self.recycle and filled.done() and not filled.cancelled():
                self.staging.give(buf)
        self.blocks_received += n
        self.bytes_received += n * self.layout.nbytes + (self.state_bytes if msg.state else 0)
        await ch.send(protocol.PushDone(n + (1 if msg.state else 0)))


class DecodeEndpoint:
    """The listener on the process's transfer loop; ``port`` is what ``/kv/info`` reports as ``transfer_port``."""

    def __init__(self, engine: Any, port: int = 0, accepting: Callable[[], bool] = lambda: True,
                 token: TokenSource = no_token, host: str = "0.0.0.0") -> None:
        self.handler = DecodeHandler(engine, accepting=accepting)
        self.loop = shared_loop()
        self.server = KVServer(self.handler, port, host=host, token=token)
        self.loop.call(self.server.start(), timeout=30.0)
        self.port = self.server.port
        log.info("KV transfer: decode endpoint on UCX port %d", self.port)

    def close(self) -> None:
        try:
            self.loop.call(self.server.close(), timeout=10.0)
        except Exception:  # noqa: BLE001 - closing anyway
            log.debug("KV transfer endpoint close failed", exc_info=True)
