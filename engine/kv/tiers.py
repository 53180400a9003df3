"""The tiers below the primary pool, as the scheduler and the engine step see them.

Prefix lookup walks a request's chain across tiers: primary hits (``KVCacheManager``), then the
host tier, then the cache node, then recompute. ``lookup`` answers the admission of one waiting
request with ``LowerHits`` (blocks to load into freshly allocated primary blocks) or ``None``
("defer": a cache-node fetch is in flight; the scheduler sets the request aside and runs others).
Per step, ``flush`` moves bytes before the forward pass (saves of evicted blocks first, then all
loads in one scatter), and ``after_step`` writes newly full blocks through to the cache node.

Invariants:

* a hash is in at most one of (primary prefix index, host tier): eviction moves it down
  (``on_evict``), promotion moves it up (``commit``), and a primary ``BlockStored`` removes it
  from the host tier (``on_primary_event``);
* hits of one admission are contiguous chain positions ``[n_primary, n_primary + num_blocks)``
  and end before the request's last token, or with ``whole`` at its end when it is block-aligned
  (``KVCacheManager.max_hit_blocks``: the step then recomputes the last token's query only);
* between ``lookup`` and ``commit``/``cancel`` (one admission, same scheduling step) the host
  blocks found are reserved, so the admission's own allocation cannot evict them;
* loads are applied by the next ``flush``, before any forward pass reads the blocks.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvmesh.engine.kv.gather import scatter_blocks
from .block_pool import KVBlock, KVIntegrityError
from .events import TIER_CPU, TIER_GPU, TIER_REMOTE, AllBlocksCleared, BlockStored, KVEvent
from .host_tier import HostTier, TierStats
from .kv_manager import CachedSegment, KVCacheManager
from .remote_tier import RemoteTier
from .state_wire import FetchedState


@dataclass
class LowerHits:
    """Blocks one admission loads from the lower tiers, in chain order: host first, then remote."""

    host_hashes: list[bytes] = field(default_factory=list)
    remote_blocks: torch.Tensor | None = None
    """``[n, layers, 2, block_size, heads, dim]`` (a view of the fetch), or None."""
    block_size: int = 0
    max_blocks: int = 0
    """The most blocks the lookup could hit (primary ones included): what the stats count as queried."""
    state: FetchedState | None = None
    """Hybrid: a checkpoint the cache node had for this chain (it may end past the KV hits)."""

    @property
    def num_blocks(self) -> int:
        return len(self.host_hashes) + (0 if self.remote_blocks is None else len(self.remote_blocks))

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


@dataclass
class TierSnapshot:
    """One tier's size and counters, as the metrics report them."""

    tier: str
    capacity_blocks: int
    used_blocks: int
    block_bytes: int
    stats: TierStats


class KVTiers:
    def __init__(self, kv: KVCacheManager, kv_cache: torch.Tensor, host: HostTier | None = None,
                 remote: RemoteTier | None = None) -> None:
        self.kv = kv
        self.kv_cache = kv_cache
        self.host = host
        self.remote = remote
        self.block_size = kv.block_size
        self._remote_loads: list[tuple[torch.Tensor, list[int], Any]] = []
        """(blocks, their primary block ids, the fetch's buffer) per admission since the last flush."""

    # ---- admission ----------------------------------------------------------------------------
    def lookup(self, request_id: str, num_tokens: int, num_primary_blocks: int,
               whole: bool = False) -> LowerHits | None:
        """Lower-tier hits after ``num_primary_blocks`` primary hits; None defers the request.

        Call right after ``KVCacheManager.get_computed_blocks`` (which extended the chain), with
        the same ``whole``.
        """
        bs = self.block_size
        max_blocks = self.kv.max_hit_blocks(num_tokens, whole)
        chain = self.kv.chain(request_id)[:max_blocks]
        hits = LowerHits(block_size=bs, max_blocks=max_blocks)
        n = num_primary_blocks
        k = self.host.count(chain[n:]) if self.host is not None else 0
        if self.remote is not None:
            f = self.remote.result(request_id)
            if f is None:
                if self.remote.is_pending(request_id):
                    return None
                if n + k < max_blocks:
                    states = chain[::-1] if self.remote.state_layout is not None else ()
                    f = self.remote.start_fetch(request_id, n + k, chain[n + k:], states)
                    if not f.done:
                        return None
                    f = self.remote.result(request_id)
            if f is not None and f.blocks is not None and len(f.blocks) and f.start <= n + k:
                # Fetched blocks cover chain[f.start : f.start + len]; use those past the local hits.
                skip = n + k - f.start
                hits.remote_blocks = f.blocks[skip:max_blocks - f.start]
            if f is not None:
                hits.state = f.state
        if k:
            hits.host_hashes = chain[n:n + k]
            self.host.reserve(hits.host_hashes)
        return hits

    def commit(self, request_id: str, hits: LowerHits, blocks: Sequence[KVBlock], num_primary_blocks: int) -> None:
        """The admission happened: ``blocks`` (freshly allocated, chain order) receive the hits."""
        k = len(hits.host_hashes)
        ids = [b.block_id for b in blocks[:hits.num_blocks]]
        max_blocks = hits.max_blocks
        if self.host is not None:
            if k:
                self.host.promote(hits.host_hashes, ids[:k])
            self.host.stats.queries += (max_blocks - num_primary_blocks) * self.block_size
            self.host.stats.hits += k * self.block_size
        if self.remote is not None:
            f = self.remote.fetch(request_id)
            got = hits.remote_blocks
            m = 0 if got is None else len(got)
            if f is not None:
                self.remote.stats.queries += len(f.hashes) * self.block_size
                self.remote.stats.hits += m * self.block_size
                self.remote.stats.promotions += m
            if m:
                self._remote_loads.append((got, ids[k:k + m], f.buffer if f is not None else None))
            self.remote.forget(request_id)

    def trim(self, hits: LowerHits, num_blocks: int) -> None:
        """Keep only the first ``num_blocks`` (>= 0) of ``hits`` (a hybrid hit ends at its last
        checkpoint): the host blocks past them go back unreserved, fetched ones are not loaded."""
        num_blocks = max(0, num_blocks)
        k = len(hits.host_hashes)
        if num_blocks < k:
            if self.host is not None:
                self.host.release(hits.host_hashes[num_blocks:])
            hits.host_hashes = hits.host_hashes[:num_blocks]
        if hits.remote_blocks is not None:
            hits.remote_blocks = hits.remote_blocks[:max(0, num_blocks - k)]

    def cancel(self, hits: LowerHits | None) -> None:
        """The admission did not happen (no room): give the reserved host blocks back."""
        if hits is not None and hits.host_hashes and self.host is not None:
            self.host.release(hits.host_hashes)

    def forget(self, request_id: str) -> None:
        if self.remote is not None:
            self.remote.forget(request_id)

    def is_deferred(self, request_id: str) -> bool:
        return self.remote is not None and self.remote.is_pending(request_id)

    # ---- per step -----------------------------------------------------------------------------
    def on_evict(self, blocks: list[KVBlock]) -> None:
        if self.host is not None:
            self.host.save(blocks)

    def on_primary_event(self, event: KVEvent) -> None:
        if self.host is None or event.tier != TIER_GPU:
            return
        if isinstance(event, BlockStored):
            self.host.discard(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            self.host.clear()

    def save_evicted(self) -> None:
        """Copy out the blocks the primary pool evicted since the last copy (queued by ``on_evict``).
        Runs before anything writes primary blocks: the forward pass (``flush``) and every write
        outside it (``LLMEngine.write_blocks``), since an evicted block is free to be reused."""
        if self.host is not None:
            self.host.flush_saves(self.kv_cache)

    def flush(self) -> None:
        """Apply pending saves, then every pending load: one scatter into the KV cache per source
        (the host tier's loads, each admission's fetch), straight from where the bytes landed."""
        self.save_evicted()
        if self.host is not None:
            loaded = self.host.take_loads()
            if loaded is not None:
                scatter_blocks(self.kv_cache, loaded[1], loaded[0])
        remote, self._remote_loads = self._remote_loads, []
        # On a GPU the scatter's host-to-device copy may still be reading the buffer when it
        # returns, so buffers go back to the pool only where the copy is synchronous.
        recycle = self.remote is not None and self.kv_cache.device.type == "cpu"
        for data, ids, buffer in remote:
            scatter_blocks(self.kv_cache, ids, data)
            if recycle:
                self.remote.recycle(buffer)

    def after_step(self, segments: Sequence[CachedSegment]) -> concurrent.futures.Future | None:
        """Write the blocks this step made full through to the cache node (asynchronously).

        Returns the future of that write (one for all of the step's segments), or None."""
        if self.remote is None or not segments:
            return None
        ids, hashes, parents = [], [], []
        for seg in segments:
            parent = seg.parent_hash
            for b, h in zip(seg.block_ids, seg.block_hashes):
                ids.append(b)
                hashes.append(h)
                parents.append(parent)
                parent = h
        return self.remote.save(self.kv_cache, ids, hashes, parents)

    # ---- reporting ----------------------------------------------------------------------------
    def snapshots(self) -> list[TierSnapshot]:
        out = []
        if self.host is not None:
            h = self.host
            out.append(TierSnapshot(TIER_CPU, h.num_slots, h.used_blocks, h.block_bytes,
                                    TierStats(**h.stats.as_dict())))
        if self.remote is not None:
            r = self.remote
            out.append(TierSnapshot(TIER_REMOTE, 0, 0, r.layout.nbytes, r.snapshot_stats()))
        return out

    def check_integrity(self) -> None:
        if self.host is None:
            return
        self.host.check_integrity()
        both = self.host.hashes() & self.kv.pool.cached.keys()
        if both:
            raise KVIntegrityError(f"{len(both)} block hashes are cached in both the primary pool and the host tier")
