"""Client side of the KV block protocol: an asyncio client, and a facade for plain threads.

``AsyncKVClient`` runs on the loop that drives ucxx. It keeps a small pool of connections
(``max_connections``), so a big write-through ``put`` does not queue a latency-critical ``get``
behind it. ``KVClient`` wraps one for an engine's step thread: every call returns a
``concurrent.futures.Future`` immediately and the work runs on a ``LoopThread``.

Failure semantics (what a caller may rely on):

* a miss is an answer (``lookup`` -> 0, ``get`` -> fewer blocks), never an exception;
* every failure is a ``TransferError``: ``ConnectFailed``, ``PeerGone`` (peer died or restarted
  mid-request), ``TransferTimeout`` (the request's deadline passed), ``HeaderMismatch`` (the
  peer's blocks are not what this side expects), ``ProtocolError``, ``RemoteError``;
* a connection that saw any failure or timeout is aborted, never reused, so a late reply can
  not be read as the answer to the next request; the next request reconnects;
* a request whose pooled connection fails before the peer answers anything (the peer restarted
  since) is retried once on a fresh connection within the same deadline, so a restarted peer
  shows up as misses; a failure after the peer started answering is raised;
* blocks returned by ``get`` passed ``check_header`` against the caller's layout and are exactly
  a prefix of the asked hashes; ``put`` reads the caller's arrays until its future is done.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import ucxx
from ucxx.exceptions import UCXError

from . import auth, protocol, shm_lane, ucx_payloads
from kvmesh.engine.block_hash import ROOT_HASH
from .auth import TokenSource, no_token
from .buffers import KVBlock
from .channel import Channel
from .errors import (AuthFailed, ConnectFailed, HeaderMismatch, LaneMismatch, PeerGone, ProtocolError, RemoteError,
                     TransferError, TransferTimeout)
from .header import KIND_STATE, BlockBatch, BlockLayout, check_batch
from .loop_thread import LoopThread
from .posted import start
from .staging import StagingPool

T = TypeVar("T")


class _StalePooled(PeerGone):
    """A pooled connection failed before the peer answered anything: it predates a peer restart."""


class ClientBusy(TransferError):
    """Too many requests are already pending on this client; the new one was not started."""


def raise_error_reply(reply: protocol.ErrorReply) -> None:
    """Raise the peer's complete error answer; ``answered`` marks it: the stream is where it should
    be, so the connection stays usable (see ``_attempt``)."""
    if reply.kind == protocol.ERR_HEADER:
        e: TransferError = HeaderMismatch(reply.field or "?", reply.expected, reply.got,
                                          f"rejected by the peer: {reply.message}")
    else:
        e = RemoteError(f"peer answered {reply.kind}: {reply.message}", reply.kind)
    e.answered = True  # type: ignore[attr-defined]
    raise e


class AsyncKVClient:
    """Talks to one KV block server (a cache node, later a decode engine) at ``host:port``."""

    def __init__(self, host: str, port: int, *, timeout: float = 10.0, connect_timeout: float = 5.0,
                 max_connections: int = 2, token: TokenSource = no_token, shm: bool | None = None,
                 lane_chunk_bytes: int = shm_lane.DEFAULT_CHUNK_BYTES, staging: StagingPool | None = None) -> None:
        """``token``: the deployment's internal token, proven to the peer and required of it on
        every new connection (transfer/auth.py). ``shm``: offer a same-host lane on each new
        connection (``shm_lane``; default: on unless ``KVMESH_KV_SHM=0``). ``staging``: where a
        ``get`` lands its batch (buffers its caller hands back after use), else fresh memory."""
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.host, self.port = host, port
        self.peer = f"{host}:{port}"
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.token = token
        self.shm = shm_lane.enabled_by_env() if shm is None else shm
        self.lane_chunk_bytes = lane_chunk_bytes
        self.staging = staging
        self._slots: asyncio.Semaphore | None = None  # created on the loop that uses it
        self._max = max_connections
        self._idle: list[Channel] = []
        self._busy: set[Channel] = set()
        self._closed = False
        self._handshake: asyncio.Task | None = None  # the handshake under way, if any (see _connect)
        self._handshake_waiters = 0
        self._copy_slots = ucx_payloads.Slots()  # every connection's payload copies share these

    # ---- requests -------------------------------------------------------------------------------
    async def put(self, blocks: Sequence[KVBlock], timeout: float | None = None) -> list[str]:
        """Store ``blocks`` (one layout); per block one of ``protocol.PUT_STATUSES``.

        A node takes at most its per-put share (``--max-put``) of one offer and answers ``no_room``
        for the rest, so the blocks it had no room for are offered again on the same connection
        once the first ones have arrived (their room is free again), until every block has an
        answer or a round makes no progress (the node's whole in-flight room is taken by others:
        those blocks stay ``no_room``)."""
        if not blocks:
            return []
        check_batch(BlockBatch.of([b.header for b in blocks]))  # refuse locally what the server would refuse

        async def offer(ch: Channel, part: Sequence[KVBlock]) -> list[str]:
            await ch.send(protocol.PutOffer(BlockBatch.of([b.header for b in part])))
            want = await ch.expect(protocol.PutWant)
            if isinstance(want, protocol.ErrorReply):
                raise_error_reply(want)
            if len(want.want) != len(part):
                raise ProtocolError(f"{self.peer} answered a {len(part)}-block offer with {len(want.want)} flags")
            await ch.send_payloads([b.data for b, w in zip(part, want.want) if w])
            done = await ch.expect(protocol.PutDone)
            if isinstance(done, protocol.ErrorReply):
                raise_error_reply(done)
            if len(done.statuses) != len(part):
                raise ProtocolError(f"{self.peer} sent {len(done.statuses)} put statuses for {len(part)} blocks")
            return list(done.statuses)

        async def run(ch: Channel) -> list[str]:
            statuses = [protocol.NO_ROOM] * len(blocks)
            todo = list(range(len(blocks)))
            while todo:
                got = await offer(ch, [blocks[i] for i in todo])
                for i, s in zip(todo, got):
                    statuses[i] = s
                again = [i for i, s in zip(todo, got) if s == protocol.NO_ROOM]
                if len(again) == len(todo):
                    break
                todo = again
            return statuses

        return await self._request(run, timeout, f"put of {len(blocks)} blocks")

    async def lookup(self, hashes: Sequence[bytes], timeout: float | None = None) -> int:
        """Length of the longest prefix of the chain ``hashes`` the peer holds."""
        if not hashes:
            return 0

        async def run(ch: Channel) -> int:
            await ch.send(protocol.Lookup(list(hashes)))
            reply = await ch.expect(protocol.LookupReply)
            if isinstance(reply, protocol.ErrorReply):
                raise_error_reply(reply)
            if not 0 <= reply.length <= len(hashes):
                raise ProtocolError(f"{self.peer} answered a {len(hashes)}-hash lookup with {reply.length}")
            return reply.length

        return await self._request(run, timeout, f"lookup of {len(hashes)} hashes")

    async def get(self, layout: BlockLayout, hashes: Sequence[bytes], timeout: float | None = None) -> list[KVBlock]:
        """Blocks for the longest held prefix of ``hashes``, each checked against ``layout``; for a
        state layout, the checkpoint of the first of ``hashes`` the node holds (at most one)."""
        if not hashes:
            return []

        async def run(ch: Channel) -> list[KVBlock]:
            await ch.send(protocol.Get(layout, list(hashes)))
            reply = await ch.expect(protocol.GetReply)
            if isinstance(reply, protocol.ErrorReply):
                raise_error_reply(reply)
            if reply.batch is None:
                return []
            batch = reply.batch
            # Checked before receiving: a mismatched block is never loaded (the channel is dropped).
            check_batch(batch, expected=layout)
            n = len(batch.hashes)
            if layout.kind == KIND_STATE:  # one checkpoint: the first asked hash the node holds
                if n != 1 or batch.hashes[0] not in hashes:
                    raise HeaderMismatch("block_hash", "one of the asked checkpoints", f"{n} other hashes")
            elif n > len(hashes) or batch.hashes != list(hashes[:n]):
                raise HeaderMismatch("block_hash", "a prefix of the asked chain", f"{n} other hashes")
            # One buffer for the batch: the blocks come back as consecutive views of it, so a
            # receiver that loads them all (the engine's remote tier) scatters with no copy first.
            nb = layout.nbytes
            buf = self.staging.take(n * nb) if self.staging is not None else np.empty(n * nb, np.uint8)
            views = [buf[i * nb:(i + 1) * nb] for i in range(n)]
            await ch.recv_payloads_into(views)
            return [KVBlock(h, d) for h, d in zip(batch.headers(), views)]

        return await self._request(run, timeout, f"get of {len(hashes)} blocks")

    # ---- prefill -> decode handoff (docs/disagg.md) ------------------------------------------------
    async def reserve(self, transfer_id: str, layout: BlockLayout, prompt_token_ids: Sequence[int], max_tokens: int,
                      timeout: float | None = None, root: bytes = ROOT_HASH,
                      state: BlockLayout | None = None) -> protocol.Reserved | protocol.ErrorReply:
        """Ask a decode engine to reserve blocks; a refusal (no room, too large, header) is returned.
        ``state``: a hybrid model's recurrent-state layout (the final push carries that state)."""

        async def run(ch: Channel) -> protocol.Reserved | protocol.ErrorReply:
            await ch.send(protocol.Reserve(transfer_id, layout, list(prompt_token_ids), max_tokens,
                                           b"" if root == ROOT_HASH else root, state))
            reply = await ch.expect(protocol.Reserved)
            if isinstance(reply, protocol.ErrorReply) and reply.kind == protocol.ERR_INTERNAL:
                raise_error_reply(reply)
            return reply

        return await self._request(run, timeout, f"reservation of {transfer_id}")

    async def push(self, push: protocol.PushKV, payloads: Sequence[Any], timeout: float | None = None) -> int:
        """Send one part of a handoff; returns the blocks the decode engine stored. Any refusal raises."""

        async def run(ch: Channel) -> int:
            await ch.send(push)
            ready = await ch.expect(protocol.PushReady)
            if isinstance(ready, protocol.ErrorReply):
                raise_error_reply(ready)
            await ch.send_payloads(payloads)
            done = await ch.expect(protocol.PushDone)
            if isinstance(done, protocol.ErrorReply):
                raise_error_reply(done)
            if done.num_blocks != len(payloads):
                raise ProtocolError(f"{self.peer} stored {done.num_blocks} of {len(payloads)} pushed blocks")
            return done.num_blocks

        return await self._request(run, timeout, f"push of {len(payloads)} blocks for {push.transfer_id}")

    async def cancel(self, transfer_id: str, timeout: float | None = None) -> None:
        async def run(ch: Channel) -> None:
            await ch.send(protocol.Cancel(transfer_id))
            reply = await ch.expect(protocol.Cancelled)
            if isinstance(reply, protocol.ErrorReply):
                raise_error_reply(reply)

        await self._request(run, timeout, f"cancel of {transfer_id}")

    async def stats(self, timeout: float | None = None) -> dict[str, Any]:
        async def run(ch: Channel) -> dict[str, Any]:
            await ch.send(protocol.Stats())
            reply = await ch.expect(protocol.StatsReply)
            if isinstance(reply, protocol.ErrorReply):
                raise_error_reply(reply)
            return dict(reply.stats)

        return await self._request(run, timeout, "stats")

    # ---- connections ----------------------------------------------------------------------------
    async def _request(self, run: Callable[[Channel], Awaitable[T]], timeout: float | None, what: str) -> T:
        if self._closed:
            raise TransferError(f"client for {self.peer} is closed")
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._max)
        deadline = self.timeout if timeout is None else timeout
        try:
            async with asyncio.timeout(deadline):
                async with self._slots:
                    try:
                        return await self._attempt(run, reuse=True)
                    except _StalePooled:
                        # A pooled connection may predate a restart of the peer. Every request is
                        # idempotent (puts by hash), so one retry on a fresh connection is safe.
                        return await self._attempt(run, reuse=False)
        except TimeoutError:
            raise TransferTimeout(f"{what} with {self.peer} did not finish within {deadline:.1f}s") from None

    async def _attempt(self, run: Callable[[Channel], Awaitable[T]], reuse: bool) -> T:
        ch = self._pooled() if reuse else None
        fresh = ch is None
        if ch is None:
            ch = await self._connect()
        self._busy.add(ch)
        heard = ch.received
        try:
            result = await run(ch)
        except PeerGone:
            self._drop(ch)
            if fresh or ch.received != heard:
                raise  # a new connection failed, or the peer died mid-answer: it really is gone
            raise _StalePooled(f"stale pooled connection to {self.peer}") from None
        except TransferError as e:
            if getattr(e, "answered", False):
                self._release(ch)  # a refusal on a healthy connection: other requests keep using it
            else:
                self._drop(ch)
            raise
        except BaseException:
            self._drop(ch)  # failed or timed out: the stream position is unknown
            raise
        self._release(ch)
        return result

    def _release(self, ch: Channel) -> None:
        self._busy.discard(ch)
        if self._closed or ch.broken:
            ch.abort()
        else:
            self._idle.append(ch)

    def _handshake_done(self, attempt: asyncio.Task) -> None:
        if self._handshake is not attempt:
            return  # a caller took it
        if attempt.cancelled() or attempt.exception() is not None:
            self._handshake = None  # failed: the next connect starts a fresh one
        elif self._handshake_waiters == 0 or self._closed:
            self._handshake = None
            attempt.result().abort()  # connected after every caller gave up

    def _pooled(self) -> Channel | None:
        while self._idle:
            ch = self._idle.pop()
            if ch.alive:
                return ch
            ch.abort()
        return None

    def _drop(self, ch: Channel) -> None:
        self._busy.discard(ch)
        ch.abort()

    async def _connect(self) -> Channel:
        # ucxx's handshake receives the peer's info into a buffer that is freed when the handshake
        # is abandoned (its own connect_timeout, or a cancel) while UCX keeps the receive posted: a
        # peer that answers late (a stalled process resumed) then writes into freed memory. So a
        # handshake is never abandoned: it runs without a timeout of its own (``posted.start``) and
        # callers only stop waiting for it. There is at most one per client; a caller that finds
        # one under way waits for it instead of starting another, and an endpoint that connects
        # after every caller gave up is aborted (``_handshake_done``).
        while True:
            attempt = self._handshake
            if attempt is None:
                attempt = self._handshake = start(ucxx.create_endpoint(self.host, self.port, connect_timeout=None))
                attempt.add_done_callback(self._handshake_done)
            self._handshake_waiters += 1
            try:
                ep = await asyncio.wait_for(asyncio.shield(attempt), self.connect_timeout)
            except (UCXError, OSError, TimeoutError) as e:
                raise ConnectFailed(f"cannot connect to KV peer {self.peer}: {type(e).__name__}: "
                                    f"{e or 'timed out'} (is it running and is its UCX port reachable?)") from None
            finally:
                self._handshake_waiters -= 1
            if self._handshake is attempt:  # the first caller to wake takes the endpoint
                self._handshake = None
                break
        ch = Channel(ep, self.peer, self._copy_slots)
        try:
            mine = auth.nonce()
            await ch.send(protocol.Hello(protocol.PROTOCOL_VERSION, "client", mine))
            hello = await ch.expect(protocol.Hello)
            if isinstance(hello, protocol.ErrorReply):
                raise_error_reply(hello)
            if hello.version != protocol.PROTOCOL_VERSION:
                raise ProtocolError(f"{self.peer} speaks KV protocol {hello.version}, "
                                    f"this side {protocol.PROTOCOL_VERSION}")
            await self._authenticate(ch, mine, hello)
            if self.shm:
                try:
                    await ch.offer_lane(self.lane_chunk_bytes)
                except LaneMismatch:
                    self.shm = False  # the next connection goes without: this one failing once is enough
                    raise
        except BaseException:
            ch.abort()
            raise
        return ch

    async def _authenticate(self, ch: Channel, mine: bytes, hello: protocol.Hello) -> None:
        """Prove the token to a server that asks, after it proved it to us (transfer/auth.py)."""
        token = self.token()
        if not hello.nonce:
            if token:
                raise AuthFailed(f"KV peer {self.peer} does not check the internal token; give it "
                                 "--auth-token-file too (this side will not talk to an unauthenticated peer)")
            return
        if not token:
            raise AuthFailed(f"KV peer {self.peer} needs the deployment's internal token; this side has "
                             "none (--auth-token-file)")
        if not auth.valid(token, auth.SERVER, mine, hello.nonce, hello.proof):
            raise AuthFailed(f"KV peer {self.peer} did not prove the internal token (another deployment's "
                             "peer, or an impostor)")
        await ch.send(protocol.Auth(auth.proof(token, auth.CLIENT, hello.nonce, mine)))
        reply = await ch.expect(protocol.AuthOk)
        if isinstance(reply, protocol.ErrorReply):
            raise AuthFailed(f"KV peer {self.peer} refused this side's token: {reply.message}")

    async def warm(self, n: int = 1) -> int:
        """Open connections (handshake, token, lane) until ``n`` are pooled, so the first request
        does not pay for them; returns how many are pooled. A failure raises like a request's."""
        if self._closed:
            raise TransferError(f"client for {self.peer} is closed")
        while len(self._idle) + len(self._busy) < min(n, self._max):
            self._idle.append(await self._connect())
        return len(self._idle)

    async def aclose(self) -> None:
        """Close every connection (idle ones cleanly, in-flight ones abort). Idempotent."""
        self._closed = True
        idle, self._idle = self._idle, []
        for ch in idle:
            await ch.close()
        for ch in list(self._busy):
            ch.abort()
        self._busy.clear()

    @property
    def open_connections(self) -> int:
        return len(self._idle) + len(self._busy)

    @property
    def lanes(self) -> int:
        """Open connections that move payloads through a same-host lane."""
        return sum(1 for ch in (*self._idle, *self._busy) if ch.lane is not None)


class KVClient:
    """Thread-facing client: each call returns a ``concurrent.futures.Future`` at once.

    At most ``max_pending`` requests run or wait at a time; beyond that a call raises
    ``ClientBusy`` immediately (write-through drops and counts the save, the step goes on).
    ``loop`` may be shared with other transfer users of the process; when omitted the client
    starts and owns one.
    """

    def __init__(self, host: str, port: int, *, loop: LoopThread | None = None, max_pending: int = 64,
                 **client_kw: Any) -> None:
        self._own_loop = loop is None
        self._loop = loop or LoopThread()
        self._client = AsyncKVClient(host, port, **client_kw)
        self._max_pending = max_pending
        self._pending = 0
        self._lock = threading.Lock()

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending

    def _submit(self, coro: Any) -> concurrent.futures.Future:
        with self._lock:
            if self._pending >= self._max_pending:
                coro.close()
                raise ClientBusy(f"{self._pending} KV requests already pending for {self._client.peer}")
            self._pending += 1
        try:
            fut = self._loop.submit(coro)
        except BaseException:
            with self._lock:
                self._pending -= 1
            raise
        fut.add_done_callback(self._done)
        return fut

    def _done(self, _fut: concurrent.futures.Future) -> None:
        with self._lock:
            self._pending -= 1

    @property
    def open_connections(self) -> int:
        """Connections currently pooled or in use (read from another thread: a gauge, not a lock)."""
        return self._client.open_connections

    def put(self, blocks: Sequence[KVBlock], timeout: float | None = None) -> concurrent.futures.Future[list[str]]:
        return self._submit(self._client.put(blocks, timeout))

    def lookup(self, hashes: Sequence[bytes], timeout: float | None = None) -> concurrent.futures.Future[int]:
        return self._submit(self._client.lookup(hashes, timeout))

    def get(self, layout: BlockLayout, hashes: Sequence[bytes],
            timeout: float | None = None) -> concurrent.futures.Future[list[KVBlock]]:
        return self._submit(self._client.get(layout, hashes, timeout))

    def stats(self, timeout: float | None = None) -> concurrent.futures.Future[dict[str, Any]]:
        return self._submit(self._client.stats(timeout))

    def warm(self, n: int = 1) -> concurrent.futures.Future[int]:
        return self._submit(self._client.warm(n))

    def close(self, timeout: float = 10.0) -> None:
        """Close the connections, then the loop thread if this client owns it."""
        try:
            self._loop.call(self._client.aclose(), timeout)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass
        if self._own_loop:
            self._loop.close(timeout)

    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

