"""The remote tier: a cache node reached over the KV block transport (tier ``remote``).

Two jobs, both asynchronous to the engine step:

* write-through: ``save`` gathers the blocks a step made full (one gather from the KV cache)
  and hands them to ``KVClient.put``; the step never waits. Saves are bounded by
  ``max_inflight_bytes``; beyond it, or when the client is busy or the node unknown, a save is
  dropped and counted.
* fetch: ``start_fetch`` asks the node for the blocks of a chain (one batched ``get``: the node
  answers the longest prefix it holds, so a separate lookup would only add a round trip). The
  request stays waiting (set aside by the scheduler) until ``done``; the engine polls futures,
  never blocks on them. Any failure (no node, connect failure, timeout, peer gone, header
  mismatch) is a miss: the blocks are recomputed.

Hybrid models (``enable_states``): a fetch also asks for one recurrent-state checkpoint (a
second ``get`` with the checkpoint layout, candidate boundaries deepest first; the node answers
the first it holds), and ``save_states`` writes published checkpoints through like blocks. A
checkpoint whose layout differs (conv/recurrent shapes, dtypes, bytes) is refused by the node
before any byte moves; the engine counts it in ``state_stats.failures`` and recomputes.

Invariants: a fetch's blocks passed ``check_header`` against this engine's layout (model
identity, dtype, geometry) and are exactly a prefix of the asked hashes; a fetch result is used
at most once; nothing here raises into the step for a transport failure.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from kvmesh.engine.kv.gather import gather_blocks
from ..transfer.buffers import KVBlock as WireBlock
from ..transfer.buffers import as_bytes, covering
from ..transfer.errors import HeaderMismatch, TransferError
from ..transfer.header import BlockHeader, BlockLayout
from ..transfer.staging import StagingPool
from kvmesh.engine.block_hash import BlockHash
from .host_tier import TierStats
from .state_wire import FetchedState, StateGeometry, gather_entries, split_payload

log = logging.getLogger("kvmesh.engine.remote")


class BlockClient(Protocol):
    """What the tier needs from ``transfer.client.KVClient``."""

    def put(self, blocks: Sequence[WireBlock], timeout: float | None = None) -> concurrent.futures.Future: ...

    def get(self, layout: BlockLayout, hashes: Sequence[bytes],
            timeout: float | None = None) -> concurrent.futures.Future: ...


@dataclass
class Fetch:
    """One request's outstanding or finished fetch: blocks for ``hashes`` = chain[start:...]."""

    start: int
    hashes: list[BlockHash]
    future: concurrent.futures.Future | None
    blocks: torch.Tensor | None = None
    """Set once done: ``[n, layers, 2, block_size, heads, dim]``, n = 0 on a miss or failure."""
    buffer: np.ndarray | None = None
    """The bytes under ``blocks`` as they landed (handed back with ``RemoteTier.recycle``)."""
    state_hashes: list[BlockHash] | None = None
    """Hybrid: the checkpoint candidates asked for, deepest first (``hashes[i]`` ends chain block i)."""
    state_future: concurrent.futures.Future | None = None
    state: FetchedState | None = None
    """Set once done: the checkpoint fetched, or None."""

    @property
    def done(self) -> bool:
        return ((self.future is None or self.future.done())
                and (self.state_future is None or self.state_future.done()))


def one_buffer(datas: Sequence[np.ndarray]) -> np.ndarray:
    """The payloads as one flat array: a view when they lie back to back in one buffer (as
    ``KVClient.get`` returns them), else one copy."""
    flat = covering(datas)
    return np.concatenate(datas) if flat is None else flat


class RemoteTier:
    """``clients()`` returns (fetch client, save client), or None while the node is unknown."""

    def __init__(self, clients: Callable[[], tuple[BlockClient, BlockClient] | None], layout: BlockLayout,
                 block_shape: tuple[int, ...], dtype: torch.dtype, *, timeout: float = 5.0,
                 max_inflight_bytes: int = 256 << 20, on_failure: Callable[[Exception], None] | None = None,
                 staging: StagingPool | None = None) -> None:
        """``staging``: the pool the fetch client lands batches in; ``recycle`` hands them back."""
        self._clients = clients
        self.layout = layout
        self.block_shape = block_shape
        self.dtype = dtype
        self.timeout = timeout
        self.max_inflight_bytes = max_inflight_bytes
        self._on_failure = on_failure
        self._staging = staging
        self.last_fetch: tuple[int, float] | None = None
        """(bytes, seconds from asking to holding them) of the latest fetch that succeeded."""
        self._fetches: dict[str, Fetch] = {}
        self._lock = threading.Lock()  # counters touched by transfer-loop callbacks
        self._inflight_bytes = 0
        self.stats = TierStats()
        self.state_layout: BlockLayout | None = None
        self.state_geometry: StateGeometry | None = None
        self.state_stats = TierStats()
        """Checkpoints: queries = gets asked, hits = checkpoints fetched, stored/dropped = saves."""

    def enable_states(self, layout: BlockLayout, geometry: StateGeometry) -> None:
        """Carry a hybrid model's checkpoints too (fetched with blocks, written through on publish)."""
        if layout.nbytes != geometry.nbytes:
            raise ValueError(f"checkpoint layout of {layout.nbytes} bytes for tensors of {geometry.nbytes}")
        self.state_layout, self.state_geometry = layout, geometry

    # ---- fetch --------------------------------------------------------------------------------
    def fetch(self, request_id: str) -> Fetch | None:
        return self._fetches.get(request_id)

    def start_fetch(self, request_id: str, start: int, hashes: Sequence[BlockHash],
                    state_hashes: Sequence[BlockHash] = ()) -> Fetch:
        """Begin fetching ``hashes`` (chain positions ``start...``) and, for a hybrid model, the
        first held checkpoint of ``state_hashes`` (deepest first); never blocks or raises."""
        clients = self._clients()
        fut = sfut = None
        if clients is not None and hashes:
            try:
                fut = clients[0].get(self.layout, list(hashes), self.timeout)
            except TransferError as e:  # ClientBusy: treat as a miss
                self._failed(e)
        if clients is not None and state_hashes and self.state_layout is not None:
            self.state_stats.queries += 1
            try:
                sfut = clients[0].get(self.state_layout, list(state_hashes), self.timeout)
            except TransferError as e:
                self._failed(e, stats=self.state_stats)
        f = Fetch(start, list(hashes), fut, state_hashes=list(state_hashes), state_future=sfut)
        if fut is not None:
            t0 = time.perf_counter()
            fut.add_done_callback(lambda done, t0=t0: self._fetched(done, t0))
        self._fetches[request_id] = f
        return f

    def _fetched(self, fut: concurrent.futures.Future, t0: float) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return
        with self._lock:
            self.last_fetch = (len(fut.result()) * self.layout.nbytes, time.perf_counter() - t0)

    def pending(self) -> list[concurrent.futures.Future]:
        return [fut for f in self._fetches.values() for fut in (f.future, f.state_future)
                if fut is not None and not fut.done()]

    def is_pending(self, request_id: str) -> bool:
        f = self._fetches.get(request_id)
        return f is not None and not f.done

    def result(self, request_id: str) -> Fetch | None:
        """The request's finished fetch with ``blocks`` filled (no rows on any failure), or None."""
        f = self._fetches.get(request_id)
        if f is None or not f.done:
            return None
        if f.blocks is None:
            f.blocks, f.buffer = self._blocks_of(f) if f.future is not None else (self._none(), None)
            f.state = self._state_of(f)
        return f

    def _state_of(self, f: Fetch) -> FetchedState | None:
        if f.state_future is None:
            return None
        try:
            got: list[WireBlock] = f.state_future.result(timeout=0)
        except (TransferError, concurrent.futures.CancelledError, RuntimeError) as e:
            self._failed(e, stats=self.state_stats)  # a refused layout lands here: recompute
            return None
        if not got:
            return None
        blk = got[0]
        if blk.header.layout != self.state_layout or blk.block_hash not in f.state_hashes:  # belt and braces
            self._failed(HeaderMismatch("block_hash", "an asked checkpoint", blk.block_hash), stats=self.state_stats)
            return None
        conv, ssm = split_payload(blk.data, self.state_geometry)
        self.state_stats.hits += 1
        return FetchedState(len(f.state_hashes) - f.state_hashes.index(blk.block_hash), blk.block_hash, conv, ssm)

    def recycle(self, buffer: np.ndarray | None) -> None:
        """A fetched batch is in the KV cache now: its buffer may receive the next fetch."""
        if buffer is not None and self._staging is not None:
            self._staging.give(buffer)

    def _none(self) -> torch.Tensor:
        return torch.empty((0, *self.block_shape), dtype=self.dtype)

    def _blocks_of(self, f: Fetch) -> tuple[torch.Tensor, np.ndarray | None]:
        assert f.future is not None
        try:
            got: list[WireBlock] = f.future.result(timeout=0)
        except (TransferError, concurrent.futures.CancelledError, RuntimeError) as e:
            self._failed(e)
            return self._none(), None
        n = 0
        for want, blk in zip(f.hashes, got):
            if blk.block_hash != want or blk.header.layout != self.layout:  # the client checked; belt and braces
                self._failed(HeaderMismatch("block_hash", want, blk.block_hash))
                break
            n += 1
        if not n:
            return self._none(), None
        flat = one_buffer([b.data for b in got[:n]])
        return torch.from_numpy(flat).view(self.dtype).view(n, *self.block_shape), flat

    def forget(self, request_id: str) -> None:
        """Drop the request's fetch (admitted, finished or aborted); a running get is abandoned."""
        self._fetches.pop(request_id, None)

    # ---- write-through ------------------------------------------------------------------------
    def save(self, kv_cache: torch.Tensor, block_ids: Sequence[int], hashes: Sequence[BlockHash],
             parents: Sequence[BlockHash | None]) -> concurrent.futures.Future | None:
        """Write the listed (full, cached) primary blocks through to the node; never waits.

        Returns the put's future (done once the node confirmed or the put failed), or None when
        the save was dropped at once."""
        n = len(block_ids)
        if not n:
            return None

        def wire() -> tuple[list[WireBlock], Any]:
            # One gather: [n, layers, 2, block_size, heads, dim], each row one block's wire payload.
            data = gather_blocks(kv_cache, block_ids)
            flat = as_bytes(data).reshape(n, -1)
            return [WireBlock(BlockHeader(self.layout, h, p), flat[i])
                    for i, (h, p) in enumerate(zip(hashes, parents))], data

        return self._put(n, n * self.layout.nbytes, wire, self.stats)

    def save_states(self, ckpt_conv: torch.Tensor, ckpt_ssm: torch.Tensor, entries: Sequence[int],
                    hashes: Sequence[BlockHash]) -> concurrent.futures.Future | None:
        """Write published checkpoints (device entries ``entries`` under ``hashes``) through to
        the node, like ``save``: one gather now (the entries stay valid until the next step's
        plan may reuse them), the put in the background, dropped and counted past the bound."""
        n = len(entries)
        if not n or self.state_layout is None:
            return None
        layout = self.state_layout

        def wire() -> tuple[list[WireBlock], Any]:
            data = gather_entries(ckpt_conv, ckpt_ssm, entries)
            return [WireBlock(BlockHeader(layout, h, None), data[i]) for i, h in enumerate(hashes)], data

        return self._put(n, n * layout.nbytes, wire, self.state_stats)

    def _put(self, n: int, size: int, wire: Callable[[], tuple[list[WireBlock], Any]],
             stats: TierStats) -> concurrent.futures.Future | None:
        """Admit ``size`` bytes under the in-flight bound (else drop and count ``n`` in ``stats``),
        gather with ``wire`` (blocks, and the buffer they view, kept alive until the put is done)
        and start the put without waiting."""
        clients = self._clients()
        with self._lock:
            if clients is None or self._inflight_bytes + size > self.max_inflight_bytes:
                stats.dropped += n
                return None
            self._inflight_bytes += size
        blocks, data = wire()
        try:
            fut = clients[1].put(blocks, self.timeout)
        except TransferError as e:  # ClientBusy
            with self._lock:
                self._inflight_bytes -= size
                stats.dropped += n
            self._failed(e, count=False)
            return None
        fut.add_done_callback(lambda f, data=data: self._saved(f, n, size, data, stats))
        return fut

    def _saved(self, fut: concurrent.futures.Future, n: int, size: int, _data: Any,
               stats: TierStats | None = None) -> None:
        stats = self.stats if stats is None else stats
        with self._lock:
            self._inflight_bytes -= size
        try:
            statuses = fut.result()
        except (TransferError, concurrent.futures.CancelledError, RuntimeError) as e:
            with self._lock:
                stats.dropped += n
            self._failed(e, stats=stats)
            return
        with self._lock:
            stats.stored += sum(1 for s in statuses if s == "stored")
            stats.dropped += sum(1 for s in statuses if s not in ("stored", "exists"))

    @property
    def inflight_bytes(self) -> int:
        with self._lock:
            return self._inflight_bytes

    def _failed(self, e: BaseException, count: bool = True, stats: TierStats | None = None) -> None:
        if count:
            with self._lock:
                (self.stats if stats is None else stats).failures += 1
        log.debug("cache node: %s: %s (recompute)", type(e).__name__, e)
        if self._on_failure is not None and isinstance(e, Exception):
            self._on_failure(e)

    def snapshot_stats(self) -> TierStats:
        with self._lock:
            return TierStats(**self.stats.as_dict())

    def snapshot_state_stats(self) -> TierStats:
        with self._lock:
            return TierStats(**self.state_stats.as_dict())
