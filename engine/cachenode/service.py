"""The cache node's answers to the KV block protocol: ``transfer.protocol`` requests -> ``BlockStore``.

Failure semantics: a rejected header is answered with ``ErrorReply(header_mismatch)`` naming the
field, and the connection stays usable (nothing was sent after the offer). A put whose payloads do
not all arrive within ``payload_timeout`` (client died or stalled) gives every reservation back and
drops the connection; blocks already committed by earlier puts are unaffected.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ..transfer import protocol
from ..transfer.channel import Channel
from ..transfer.errors import HeaderMismatch, TransferTimeout
from ..transfer.header import BlockBatch
from .store import WANTED, BlockStore


def _error(e: HeaderMismatch) -> protocol.ErrorReply:
    return protocol.ErrorReply(protocol.ERR_HEADER, str(e), e.field, repr(e.expected), repr(e.got))


class CacheNodeHandler:
    """One per node; shared by every connection (the store does the locking)."""

    def __init__(self, store: BlockStore, *, payload_timeout: float = 60.0, max_put: int | None = None,
                 extra_stats: Callable[[], dict[str, Any]] | None = None) -> None:
        """``max_put``: bytes one put may reserve; a put runs to its end before the connection's next
        request, so this is also what one connection can hold in flight."""
        self.store = store
        self.payload_timeout = payload_timeout
        self.max_put = max_put
        self._extra_stats = extra_stats

    async def handle(self, msg: protocol.Message, ch: Channel) -> None:
        if isinstance(msg, protocol.PutOffer):
            await self._put(msg.batch, ch)
        elif isinstance(msg, protocol.Lookup):
            await ch.send(protocol.LookupReply(self.store.lookup(msg.hashes)))
        elif isinstance(msg, protocol.Get):
            await self._get(msg, ch)
        elif isinstance(msg, protocol.Stats):
            await ch.send(protocol.StatsReply(self.stats()))
        else:
            await ch.send(protocol.ErrorReply(protocol.ERR_BAD_REQUEST,
                                              f"a cache node does not answer {type(msg).__name__}"))

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.store.stats.as_dict(), capacity_bytes=self.store.capacity_bytes,
                                   used_bytes=self.store.used_bytes, reserved_bytes=self.store.reserved_bytes,
                                   blocks=self.store.num_blocks)
        if self._extra_stats is not None:
            out.update(self._extra_stats())
        return out

    async def _put(self, batch: BlockBatch, ch: Channel) -> None:
        try:
            verdicts = self.store.offer(batch, self.max_put)
        except HeaderMismatch as e:
            await ch.send(_error(e))
            return
        wanted = [i for i, v in enumerate(verdicts) if v is WANTED]
        try:
            await ch.send(protocol.PutWant([v is WANTED for v in verdicts]))
            try:
                datas = await asyncio.wait_for(ch.recv_payloads([batch.layout.nbytes] * len(wanted), self.store.buffer),
                                               self.payload_timeout)
            except TimeoutError:
                raise TransferTimeout(f"put payloads did not arrive within {self.payload_timeout:.0f}s") from None
        except BaseException:
            for i in wanted:
                self.store.abandon(batch.hashes[i], batch.layout)
            raise
        headers = batch.headers()
        statuses: list[str] = [v or "" for v in verdicts]
        for i, status in zip(wanted, self.store.commit_many([headers[i] for i in wanted], datas)):
            statuses[i] = status
        await ch.send(protocol.PutDone(statuses))

    async def _get(self, msg: protocol.Get, ch: Channel) -> None:
        try:
            blocks = self.store.get(msg.layout, msg.hashes)
        except HeaderMismatch as e:
            await ch.send(_error(e))
            return
        if not blocks:
            await ch.send(protocol.GetReply(None))
            return
        batch = BlockBatch(msg.layout, [b.header.block_hash for b in blocks], [b.header.parent_hash for b in blocks])
        await ch.send(protocol.GetReply(batch))
        # The stored arrays go out as they are (no copy); eviction only drops the store's reference.
        await ch.send_payloads([b.data for b in blocks])
