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

import dataclasses
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from kvmesh.engine.block_hash import BlockHash
from ..kv.gather import block_shape, gather_blocks
from ..kv.slot_wire import gather_state, slot_nbytes
from ..kv.kv_manager import KVCacheManager
from ..outputs import TokenLogprob
from ..request import Request
from ..transfer.protocol import FirstToken
from ..transfer.staging import StagingPool
from ..model.recurrent_state import StatePool

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
    buffer: np.ndarray | None = None
    """The staging buffer under ``data`` when it came from a pool: hand it back (``recycle``) only
    after the push that read it completed."""
    recycle: Callable[[np.ndarray], None] | None = None
    state: torch.Tensor | None = None
    """Hybrid models, final part only: the request's recurrent state at the prompt's end (flat
    uint8 host bytes in the state layout, ``kv.slot_wire``)."""

    @property
    def nbytes(self) -> int:
        kv = 0 if self.data is None else self.data.numel() * self.data.element_size()
        return kv + (0 if self.state is None else self.state.numel())


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


class PrefillRole:
    """The prefill side of handoffs as the engine step sees it.

    The step calls the hooks on its own thread: ``stream_part`` after a step computed prompt
    blocks of a streamed handoff, ``hand_off`` when the first token is sampled (the caller then
    finishes the request keeping its blocks), ``track_saves`` when the tiers write a step's
    blocks through, ``expire`` at every step and idle tick. ``release`` may be called from any
    thread: it runs on the step thread through ``post``.

    Invariant: the blocks handed over in parts and at the end are the prompt's blocks
    ``[handoff.from_block, num_blocks_for(prompt))``, each exactly once, in order
    (``Request.handoff_sent`` is the next one).
    """

    def __init__(self, kv: KVCacheManager, kv_cache: torch.Tensor, timeout_s: float,
                 post: Callable[[Callable[[], object]], Future], states: StatePool | None = None) -> None:
        """``states``: a hybrid model's state pool; the final part then carries the request's state."""
        self.kv = kv
        self.states = states
        self.kv_cache = kv_cache
        self.timeout_s = timeout_s
        self.post = post
        self.held = HeldBlocks(kv)
        # Gathers land in reused buffers on a CPU engine (no page faults per handoff); on a GPU
        # the copy to the host goes through pageable memory as before.
        self.staging = StagingPool() if kv_cache.device.type == "cpu" else None

    def __len__(self) -> int:
        """Requests whose blocks wait for their consumers."""
        return len(self.held)

    # ---- any thread -----------------------------------------------------------------------------
    def release(self, request_id: str, consumer: str) -> None:
        """``consumer`` is done with the handed-off request's blocks."""
        self.post(lambda: self.held.release(request_id, consumer))

    # ---- step-thread hooks ----------------------------------------------------------------------
    def stream_part(self, req: Request) -> KVHandoff | None:
        """The prompt blocks a streamed handoff completed since its last part (None if none did)."""
        done = min(req.num_computed_tokens, req.num_prompt_tokens) // self.kv.block_size
        return self._blocks(req, done)

    def hand_off(self, req: Request, token: int, lp: TokenLogprob | None, now: float,
                 slot: int | None = None) -> KVHandoff:
        """The first token is sampled: hold the request's blocks for the decode side and gather the
        blocks not yet handed over with the first token (and the sampler's state) for the wire.
        ``slot``: a hybrid request's state slot, which holds the state after the whole prompt now
        (the first token is not fed yet); it is copied out here, before the slot is freed."""
        n = req.num_prompt_tokens
        start = req.handoff_sent
        state_bytes = 0 if self.states is None else slot_nbytes(self.states)
        rest = self._blocks(req, self.kv.num_blocks_for(n), state_bytes)
        gen_state = bytes(req.generator.get_state().numpy().tobytes()) if req.generator is not None else None
        first = FirstToken(token, lp.logprob if lp else None, list(lp.top) if lp else [], gen_state,
                           max(0, req.num_cached_tokens))
        state = None
        if self.states is not None:
            if slot is None:
                raise ValueError(f"hybrid handoff of {req.request_id!r} without its state slot")
            # Into the tail of the part's staging buffer when there is one (recycled with it):
            # a fresh 49 MiB buffer costs 5x the copy in page faults (docs/benchmarks.md).
            tail = None if rest is None or rest.buffer is None else torch.from_numpy(rest.buffer[rest.nbytes:])
            state = gather_state(self.states, slot, tail)
        self.held.hold(req.request_id, now + self.timeout_s)
        if rest is None:
            return KVHandoff(req.request_id, start, [], None, first, n, state=state)
        return dataclasses.replace(rest, first=first, state=state)

    def track_saves(self, request_ids: Iterable[str], saved: Future) -> None:
        """These handed-off requests' blocks are being written through to the cache node: release
        them only once ``saved`` confirmed that too."""
        name = f"cache-node:{id(saved)}"
        for rid in set(request_ids):
            self.held.add_consumer(rid, name)
            saved.add_done_callback(lambda _f, rid=rid: self.release(rid, name))

    def expire(self, now: float) -> list[str]:
        """Free held requests whose consumers did not confirm in time; returns their ids."""
        return self.held.expire(now) if len(self.held) else []

    @property
    def timeouts(self) -> int:
        return self.held.timeouts

    def _blocks(self, req: Request, end: int, tail_bytes: int = 0) -> KVHandoff | None:
        """Prompt blocks ``[req.handoff_sent, end)`` gathered for the wire (None if there are none
        and no ``tail_bytes``); a staging buffer has ``tail_bytes`` more after the blocks."""
        start = req.handoff_sent
        if end <= start and not tail_bytes:
            return None
        end = max(end, start)
        n = req.num_prompt_tokens
        full = n // self.kv.block_size
        chain = self.kv.extend_chain(req.request_id, req.prompt_token_ids, min(full, end), req.kv_root)
        hashes = [chain[i] if i < full else None for i in range(start, end)]
        ids = self.kv.block_ids(req.request_id)[start:end]
        buf = out = None
        if self.staging is not None:
            shape = block_shape(self.kv_cache)
            kv_bytes = len(ids) * self.kv_cache[:, :, 0].numel() * self.kv_cache.element_size()
            buf = self.staging.take(kv_bytes + tail_bytes)
            out = torch.from_numpy(buf[:kv_bytes]).view(self.kv_cache.dtype).view(len(ids), *shape)
        data = gather_blocks(self.kv_cache, ids, out) if ids else None
        req.handoff_sent = end
        return KVHandoff(req.request_id, start, hashes, data, None, n, buf,
                         self.staging.give if self.staging is not None else None)
