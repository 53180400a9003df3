"""A prefill engine's links to decode engines: reserve before computing, push after.

One ``AsyncKVClient`` per decode address, all on one transfer loop thread; the HTTP handlers
(on the server's event loop) await them through ``asyncio.wrap_future``, so neither the server
loop nor the engine step ever runs transport code.

Failure semantics (what the server maps to HTTP, docs/disagg.md): ``Refused`` carries the decode
engine's answer to a reservation (``no_room``, ``too_large``, ``header_mismatch``); every other
failure is a ``TransferError`` (no connection, peer gone, timeout, a push the decode side
refused). A failed request drops its own connection only; a refusal (``RemoteError``) drops none.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from ..transfer.auth import TokenSource, no_token
from kvmesh.engine.block_hash import ROOT_HASH
from ..transfer import protocol
from ..transfer.buffers import as_bytes
from ..transfer.client import AsyncKVClient
from ..transfer.errors import TransferError
from ..transfer.header import BlockLayout
from ..transfer.loop_thread import shared_loop
from .prefill_side import KVHandoff

T = TypeVar("T")


class Refused(Exception):
    """The decode engine refused the reservation; ``kind`` is its ``ErrorReply`` kind."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class PushResult:
    blocks: int
    nbytes: int
    seconds: float


class DecodeLinks:
    def __init__(self, layout: BlockLayout, timeout_s: float = 30.0, connect_timeout_s: float = 5.0,
                 token: TokenSource = no_token, state_layout: BlockLayout | None = None) -> None:
        """``state_layout``: a hybrid model's recurrent-state layout, named in every reservation
        (the decode engine checks it against its own) and carried by every final push."""
        self.layout = layout
        self.state_layout = state_layout
        self.token = token
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.loop = shared_loop()
        self._clients: dict[tuple[str, int], AsyncKVClient] = {}  # touched on the loop thread only

    def _client(self, host: str, port: int) -> AsyncKVClient:
        c = self._clients.get((host, port))
        if c is None:
            c = AsyncKVClient(host, port, timeout=self.timeout_s, connect_timeout=self.connect_timeout_s,
                              max_connections=4, token=self.token)
            self._clients[(host, port)] = c
        return c

    async def _on_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        return await asyncio.wrap_future(self.loop.submit(coro))

    async def _guarded(self, host: str, port: int, coro_fn: Any) -> Any:
        # A failure drops only the connection it happened on (the client does that); the others
        # carry other handoffs to a decode engine that may be healthy, and a peer that restarted
        # is found by the client's retry on a fresh connection.
        return await coro_fn(self._client(host, port))

    async def reserve(self, host: str, port: int, transfer_id: str, prompt_token_ids: list[int],
                      max_tokens: int, root: bytes = ROOT_HASH) -> protocol.Reserved:
        """``root``: the request's chain root (its cache_salt); the decode engine hashes with it."""
        async def run(c: AsyncKVClient) -> protocol.Reserved | protocol.ErrorReply:
            return await c.reserve(transfer_id, self.layout, prompt_token_ids, max_tokens, root=root,
                                   state=self.state_layout)

        reply = await self._on_loop(self._guarded(host, port, run))
        if isinstance(reply, protocol.ErrorReply):
            raise Refused(reply.kind, reply.message)
        return reply

    async def push(self, host: str, port: int, transfer_id: str, handoff: KVHandoff, final: bool = True) -> PushResult:
        """Send one part of a handoff: its blocks, and with ``final`` the first token (parts go in order)."""
        t0 = time.perf_counter()
        payloads = [] if handoff.data is None else list(as_bytes(handoff.data).reshape(len(handoff.hashes), -1))
        state = final and handoff.state is not None
        if final and (handoff.state is None) != (self.state_layout is None):
            raise ValueError("a hybrid model's final push carries its recurrent state, another model's none")
        if state:
            payloads.append(as_bytes(handoff.state))
        msg = protocol.PushKV(transfer_id, handoff.start, list(handoff.hashes), final,
                              handoff.first if final else None, state)

        async def run(c: AsyncKVClient) -> int:
            return await c.push(msg, payloads)

        n = await self._on_loop(self._guarded(host, port, run))
        if handoff.buffer is not None and handoff.recycle is not None:
            # Pushed and acknowledged: nothing reads the buffer any more. A failed push keeps it
            # out of the pool, since an abandoned send may still be reading it.
            handoff.recycle(handoff.buffer)
        return PushResult(n - (1 if state else 0), handoff.nbytes, time.perf_counter() - t0)

    async def cancel(self, host: str, port: int, transfer_id: str) -> None:
        """Best effort: tell the decode engine to free a reservation this side will not fill."""
        async def run(c: AsyncKVClient) -> None:
            await c.cancel(transfer_id, timeout=2.0)

        try:
            await self._on_loop(self._guarded(host, port, run))
        except TransferError:
            pass  # it expires on the decode side anyway

    def close(self) -> None:
        async def close_all() -> None:
            for c in list(self._clients.values()):
                await c.aclose()
            self._clients.clear()

        try:
            self.loop.call(close_all(), timeout=5.0)
        except Exception:  # noqa: BLE001 - closing anyway
            pass
