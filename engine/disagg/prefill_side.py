"""A prefill engine's side of KV handoffs: the blocks of a finished prefill, held until every consumer confirms.

When a handoff request samples its first token the engine does not free its blocks: it gathers
them into one host buffer (``KVHandoff``, what goes on the wire) and registers the request here
with the consumers it waits for: ``decode`` (the decode engine's ``PushDone``) and one entry per
cache-node write-through still in flight for the request's blocks.

Invariants: a held request's blocks stay referenced (so neither reused nor evicted) until the
last consumer released them or the deadline passed; each held request is freed exactly once;
a release for an unknown consumer or request is ignored (a late confirmation after a timeout).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvmesh.engine.block_hash import BlockHash
from ..kv.kv_manager import KVCacheManager
from ..transfer.protocol import FirstToken

DECODE = "decode"


@dataclass
class KVHandoff:
    """A finished prefill's KV for blocks ``[start, start + len(hashes))`` of the prompt and its first token.

    ``data`` is ``[n, layers, 2, block_size, kv_heads, head_dim]`` contiguous host memory;
    ``hashes[i]`` is block ``start + i``'s chain hash (None for a partial tail block).
    """

    request_id: str
    start: int
    hashes: list[BlockHash | None]
    data: torch.Tensor | None
    first: FirstToken
    num_prompt_tokens: int

    @property
    def nbytes(self) -> int:
        return 0 if self.data is None else self.data.numel() * self.data.element_size()


@dataclass
class Held:
    request_id: str
    deadline: float
    pending: set[str] = field(default_factory=set)


class HeldBlocks:
    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self._held: dict[str, Held] = {}
        self._pending: dict[str, set[str]] = {}  # consumers registered before the request finished
        self.timeouts = 0

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    def add_consumer(self, request_id: str, consumer: str) -> None:
        """A consumer (e.g. a cache-node write of this request's blocks) the release must wait for."""
        held = self._held.get(request_id)
        (held.pending if held is not None else self._pending.setdefault(request_id, set())).add(consumer)

    def hold(self, request_id: str, deadline: float) -> None:
        """The request finished its prefill: keep its blocks until ``decode`` and the others release."""
        pending = self._pending.pop(request_id, set())
        pending.add(DECODE)
        self._held[request_id] = Held(request_id, deadline, pending)

    def release(self, request_id: str, consumer: str) -> bool:
        """``consumer`` is done with the request's blocks; True when that freed them."""
        held = self._held.get(request_id)
        if held is None:
            pending = self._pending.get(request_id)
            if pending is not None:
                pending.discard(consumer)
                if not pending:
                    del self._pending[request_id]
            return False
        held.pending.discard(consumer)
        if held.pending:
            return False
        del self._held[request_id]
        self.kv.free(request_id)
        return True

    def forget(self, request_id: str) -> None:
        """The request ended without a handoff (aborted, failed): drop consumers registered for it."""
        self._pending.pop(request_id, None)

    def expire(self, now: float) -> list[str]:
        gone = [rid for rid, h in self._held.items() if h.deadline <= now]
        for rid in gone:
            del self._held[rid]
            self.kv.free(rid)
        self.timeouts += len(gone)
        return gone

    def next_deadline(self) -> float | None:
        return min((h.deadline for h in self._held.values()), default=None)

    def pending_consumers(self, request_id: str) -> set[str]:
        held = self._held.get(request_id)
        return set(held.pending) if held is not None else set()
