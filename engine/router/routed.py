"""The router's own record of where it sent each prompt's blocks: the prefix signal for engines
that publish no KV events.

An engine started without ``--kv-events-port`` tells the router nothing of what it caches, yet it
caches every prompt it computes. The router knows which engine it sent each prompt to, so it
keeps that as an estimate of the engine's cache (as SGLang's cache-aware router does with its
tree of routed requests): a prompt's blocks are recorded on the engine it was routed to, and a
later prompt is matched against them exactly as against the event-fed index.

Invariants:
- per engine at most ``capacity`` hashes (the engine's KV pool size once its ``/metrics``
  reported it, ``DEFAULT_CAPACITY`` before), the least recently routed dropped first, as the
  engine's own LRU of free blocks would evict them;
- within one prompt the leading blocks count as the most recently used, so eviction takes a
  prompt's tail before its head and the record of a prefix stays a contiguous run from block 0;
- an engine's record is dropped with the engine, and when it restarts (its cache is empty).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvmesh.engine.block_hash import BlockHash
from kvmesh.engine.kv.events import TIER_GPU
from kvmesh.engine.router.index import NO_MATCH, PrefixMatch

DEFAULT_CAPACITY = 4096
"""Blocks recorded for an engine whose pool size is not known yet (one scrape of /metrics away)."""


class RoutedPrefixes:
    """Per engine, the block hashes of the prompts the router sent it, in LRU order.

    Not thread-safe: the router mutates and reads it from its one event loop.
    """

    def __init__(self) -> None:
        self._engines: dict[str, OrderedDict[BlockHash, None]] = {}

    def record(self, engine: str, hashes: Sequence[BlockHash], capacity: int | None) -> None:
        """``hashes`` (a prompt's chain, block 0 first) were sent to ``engine``."""
        if not hashes:
            return
        blocks = self._engines.setdefault(engine, OrderedDict())
        for h in reversed(hashes):  # block 0 ends as the most recent: tails are evicted first
            blocks[h] = None
            blocks.move_to_end(h)
        limit = max(1, capacity if capacity is not None else DEFAULT_CAPACITY)
        while len(blocks) > limit:
            blocks.popitem(last=False)

    def match(self, engine: str, hashes: Sequence[BlockHash]) -> PrefixMatch:
        """The leading run of ``hashes`` recorded on ``engine`` (counted as its gpu tier)."""
        blocks = self._engines.get(engine)
        if not blocks:
            return NO_MATCH
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return PrefixMatch(n, {TIER_GPU: n}, float(n)) if n else NO_MATCH

    def remove_engine(self, engine: str) -> None:
        self._engines.pop(engine, None)

    def size(self) -> dict[str, dict[str, int]]:
        """Recorded hashes per engine, as ``PrefixIndex.size`` reports its tiers."""
        return {e: {TIER_GPU: len(b)} for e, b in self._engines.items()}
