"""A decode engine's side of KV handoffs: reserve, fill, claim, expire. Step thread only.

Life of a transfer ``T``::

    reserve(T, prompt, max_tokens,   blocks for prompt + max_tokens taken now (or NoRoom/TooLarge);
            root)                    leading prompt blocks this engine already caches under the
                                     same chain root (the request's cache_salt) are reused
    fill(T, start, data, ...)        pushed blocks land in the reserved blocks, in order
    fill(..., final=True, first,     the last one carries the first token (and, for a hybrid model,
         state)                      the recurrent state at the prompt's end, kept with the
                                     reservation); full prompt blocks join this engine's prefix cache
    claim(T, prompt, request_id,     the HTTP request arrives (same prompt, same root): its KV
          root)                      state is renamed to the request, which starts decoding
                                     without any prefill; a hybrid request's state goes with
                                     it and lands in its slot before its first step

Invariants: a reservation holds every block its request can need for ``max_tokens`` generated
tokens, capped at ``reserve_cap_tokens`` (0: no cap), so a claimed request within the cap never
allocates again and is never the reason for a preemption (past the cap it allocates like any
request); the KV manager keys a reserved
transfer as ``transfer_key(T)`` (never a request id) until it is claimed; every reservation is
freed exactly once: by ``claim`` (ownership moves to the request), ``cancel``, ``drop_owner``
(its connection went away before the final push) or ``expire`` (no final push within the
transfer timeout, or no claim within the claim timeout after it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from kvmesh.engine.block_hash import ROOT_HASH, BlockHash
from ..kv.block_pool import KVIntegrityError
from ..kv.kv_manager import KVCacheManager
from ..outputs import TokenLogprob
from ..request import Request
from ..transfer.protocol import FirstToken
from ..roles import DecodeClaim
from .errors import HandoffError, NoRoom, TooLarge, TransferMismatch, UnknownTransfer


def transfer_key(transfer_id: str) -> str:
    """The KV manager's key for a reserved, unclaimed transfer (a namespace request ids never use)."""
    return f"kv-transfer:{transfer_id}"


@dataclass
class Reservation:
    transfer_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    hit_blocks: int
    num_blocks: int
    deadline: float
    owner: object = None
    """The connection that carried the transfer's last accepted message (reserve or push); when
    that connection drops before the final push, the reservation is freed at once. A connection
    that drops frees no transfer whose later messages went over another one."""
    next_block: int = 0
    first: FirstToken | None = None
    state: torch.Tensor | None = None
    """Hybrid models: the request's recurrent state at the prompt's end (flat uint8 host bytes in
    the state layout, ``kv.slot_wire``), from the final push until the claim hands it on."""

    @property
    def complete(self) -> bool:
        return self.first is not None


class DecodeTransfers:
    def __init__(self, kv: KVCacheManager, write_blocks: Callable[[Sequence[int], torch.Tensor], None],
                 transfer_timeout_s: float = 30.0, claim_timeout_s: float = 30.0, reserve_cap_tokens: int = 0,
                 state_bytes: int = 0) -> None:
        """``write_blocks(ids, data)`` writes pushed KV into primary blocks (``LLMEngine.write_blocks``:
        it saves evicted blocks the reservation displaced before their bytes are overwritten).
        ``state_bytes``: a hybrid model's recurrent state per request, which every final push must
        carry (0: a model without one)."""
        self.kv = kv
        self.write_blocks = write_blocks
        self.transfer_timeout_s = transfer_timeout_s
        self.claim_timeout_s = claim_timeout_s
        self.reserve_cap_tokens = reserve_cap_tokens
        self.state_bytes = state_bytes
        self._res: dict[str, Reservation] = {}
        self.expired = 0

    def __len__(self) -> int:
        return len(self._res)

    @property
    def reserved_blocks(self) -> int:
        return sum(r.num_blocks for r in self._res.values())

    def prompt_blocks(self, r: Reservation) -> int:
        return self.kv.num_blocks_for(len(r.prompt_token_ids))

    # ---- reserve ------------------------------------------------------------------------------
    def reserve(self, transfer_id: str, prompt_token_ids: Sequence[int], max_tokens: int, now: float,
                owner: object = None, root: BlockHash = ROOT_HASH) -> Reservation:
        if transfer_id in self._res:
            raise TransferMismatch(f"transfer {transfer_id!r} is already reserved")
        ids = list(prompt_token_ids)
        if not ids or max_tokens < 1:
            raise TransferMismatch("a transfer needs a non-empty prompt and max_tokens >= 1")
        # KV exists for prompt + max_tokens - 1 tokens at most (the last sampled token is never fed back).
        growth = max_tokens - 1 if not self.reserve_cap_tokens else min(max_tokens - 1, self.reserve_cap_tokens)
        total = len(ids) + growth
        need = self.kv.num_blocks_for(total)
        if need > self.kv.num_total_blocks:
            raise TooLarge(f"the request needs {need} KV blocks ({len(ids)} prompt tokens + {growth + 1} of "
                           f"max_tokens={max_tokens}); this decode engine has {self.kv.num_total_blocks} in all")
        key = transfer_key(transfer_id)
        try:
            hits, num_hit = self.kv.get_computed_blocks(key, ids, root)
            blocks = self.kv.allocate_slots(key, ids, total - num_hit, hits, num_hit, root=root)
        except Exception:
            self.kv.free(key)  # nothing of a failed reservation stays behind
            raise
        if blocks is None:
            self.kv.free(key)
            raise NoRoom(f"{need - len(hits)} free KV blocks needed, {self.kv.num_free_blocks} free "
                         f"({len(self._res)} transfers reserved)")
        self.kv.record_prefix_lookup(len(ids), num_hit)
        r = Reservation(transfer_id, ids, max_tokens, len(hits), need, now + self.transfer_timeout_s, owner,
                        next_block=len(hits))
        self._res[transfer_id] = r
        return r

    # ---- fill ---------------------------------------------------------------------------------
    def expected_hashes(self, transfer_id: str, start: int, count: int) -> list[BlockHash | None]:
        """The chain hashes this engine computes for prompt blocks ``[start, start + count)``
        (None for a partial tail block): what a push must announce."""
        r = self._get(transfer_id)
        n = len(r.prompt_token_ids)
        full = n // self.kv.block_size
        chain = self.kv.extend_chain(transfer_key(transfer_id), r.prompt_token_ids, min(full, start + count))
        return [chain[i] if i < full else None for i in range(start, start + count)]

    def check_push(self, transfer_id: str, start: int, hashes: Sequence[BlockHash | None], final: bool,
                   now: float | None = None, owner: object = None) -> Reservation:
        """Raise unless a push of ``hashes`` at ``start`` is the next part of ``transfer_id``. An
        accepted push moves the transfer to ``owner`` (the connection carrying it) and gives it
        another ``transfer_timeout_s`` from ``now``: a long prefill streaming its blocks keeps its
        reservation as long as parts keep arriving."""
        r = self._get(transfer_id)
        if r.complete:
            raise TransferMismatch(f"transfer {transfer_id!r} is already complete")
        if start != r.next_block:
            raise TransferMismatch(f"transfer {transfer_id!r}: push starts at block {start}, expected {r.next_block}")
        end = start + len(hashes)
        total = self.prompt_blocks(r)
        if end > total or (final and end != total):
            raise TransferMismatch(f"transfer {transfer_id!r}: push covers blocks [{start}, {end}) of a "
                                   f"{total}-block prompt{' (final)' if final else ''}")
        want = self.expected_hashes(transfer_id, start, len(hashes))
        for i, (w, h) in enumerate(zip(want, hashes)):
            if w != h:
                raise TransferMismatch(f"transfer {transfer_id!r}: block {start + i} hash differs from this "
                                       "engine's chain of the same prompt (another model, dtype or tokenizer?)")
        if now is not None:
            r.deadline = max(r.deadline, now + self.transfer_timeout_s)
        if owner is not None:
            r.owner = owner
        return r

    def fill(self, transfer_id: str, start: int, data: torch.Tensor | None, final: bool,
             first: FirstToken | None, now: float, state: torch.Tensor | None = None) -> None:
        """Write pushed blocks (already checked by ``check_push``) into the reserved blocks; keep a
        hybrid model's ``state`` (final push only) for the claim."""
        r = self._get(transfer_id)
        n = 0 if data is None else data.shape[0]
        if start != r.next_block:
            raise TransferMismatch(f"transfer {transfer_id!r}: fill at block {start}, expected {r.next_block}")
        if state is not None and (not final or state.numel() != self.state_bytes):
            raise TransferMismatch(f"transfer {transfer_id!r}: a recurrent state of {state.numel()} bytes in a "
                                   f"{'final' if final else 'non-final'} push; this engine takes {self.state_bytes} "
                                   "bytes with the final push")
        if final and self.state_bytes and state is None:
            raise TransferMismatch(f"transfer {transfer_id!r}: the final push of a hybrid model must carry "
                                   "the recurrent state")
        key = transfer_key(transfer_id)
        if n:
            self.write_blocks(self.kv.block_ids(key)[start:start + n], data)
        r.next_block = start + n
        r.deadline = max(r.deadline, now + self.transfer_timeout_s)
        if final:
            if first is None or r.next_block != self.prompt_blocks(r):
                raise TransferMismatch(f"transfer {transfer_id!r}: final push without the first token or blocks")
            r.first = first
            r.state = state
            self.kv.cache_blocks(key, r.prompt_token_ids, len(r.prompt_token_ids))
            r.deadline = now + self.claim_timeout_s

    # ---- claim / cancel / expire ----------------------------------------------------------------
    def claim(self, transfer_id: str, prompt_token_ids: Sequence[int], request_id: str,
              root: BlockHash = ROOT_HASH) -> Reservation:
        """Hand a complete transfer's KV to ``request_id``; raises UnknownTransfer/TransferMismatch."""
        r = self._res.get(transfer_id)
        if r is None or not r.complete:
            raise UnknownTransfer(f"no completed KV transfer {transfer_id!r} on this engine (expired, "
                                  "cancelled or never finished)")
        if list(prompt_token_ids) != r.prompt_token_ids:
            raise TransferMismatch(f"transfer {transfer_id!r} carries another prompt "
                                   f"({len(r.prompt_token_ids)} tokens) than this request ({len(prompt_token_ids)})")
        if self.kv.root(transfer_key(transfer_id)) != root:
            raise TransferMismatch(f"transfer {transfer_id!r} was reserved under another cache_salt than "
                                   "this request's")
        del self._res[transfer_id]
        self.kv.rename(transfer_key(transfer_id), request_id)
        return r

    def cancel(self, transfer_id: str) -> bool:
        r = self._res.pop(transfer_id, None)
        if r is not None:
            self.kv.free(transfer_key(transfer_id))
        return r is not None

    def drop_owner(self, owner: object) -> list[str]:
        """Free the incomplete reservations ``owner`` last carried (its connection closed)."""
        gone = [t for t, r in self._res.items() if r.owner is owner and not r.complete]
        for t in gone:
            self.cancel(t)
        return gone

    def expire(self, now: float) -> list[str]:
        gone = [t for t, r in self._res.items() if r.deadline <= now]
        for t in gone:
            self.cancel(t)
        self.expired += len(gone)
        return gone

    def next_deadline(self) -> float | None:
        return min((r.deadline for r in self._res.values()), default=None)

    def _get(self, transfer_id: str) -> Reservation:
        r = self._res.get(transfer_id)
        if r is None:
            raise UnknownTransfer(f"no reservation {transfer_id!r} on this engine (expired or cancelled)")
        return r

    def check_integrity(self) -> None:
        for t, r in self._res.items():
            held = len(self.kv.block_ids(transfer_key(t)))
            if held != r.num_blocks:
                raise KVIntegrityError(f"transfer {t!r} reserved {r.num_blocks} blocks but holds {held}")


class DecodeRole:
    """The decode side of handoffs as the engine sees it.

    The transfer endpoint (``decode_link``) calls ``reserve``, ``check_push``, ``fill``,
    ``cancel`` and ``drop_owner`` from its own thread: each runs on the step thread through
    ``post`` and its future gives the result or the ``HandoffError``. The step calls ``claim``
    when a request names a completed transfer and ``expire`` at every step and idle tick.
    """

    def __init__(self, transfers: DecodeTransfers, post: Callable[[Callable[[], object]], Future]) -> None:
        self.transfers = transfers
        self.post = post

    def __len__(self) -> int:
        """Reservations not yet claimed, cancelled or expired."""
        return len(self.transfers)

    # ---- any thread -----------------------------------------------------------------------------
    def reserve(self, transfer_id: str, prompt_token_ids: Sequence[int], max_tokens: int,
                owner: object = None, root: BlockHash = ROOT_HASH) -> Future:
        """Reserve blocks for a transfer; the future gives a ``Reservation`` or fails with
        ``NoRoom``/``TooLarge``/``TransferMismatch``."""
        ids = list(prompt_token_ids)
        return self.post(lambda: self.transfers.reserve(transfer_id, ids, max_tokens, time.monotonic(), owner=owner,
                                                        root=root))

    def check_push(self, transfer_id: str, start: int, hashes: Sequence[BlockHash | None], final: bool,
                   owner: object = None) -> Future:
        hashes = list(hashes)
        return self.post(lambda: self.transfers.check_push(transfer_id, start, hashes, final, time.monotonic(), owner))

    def fill(self, transfer_id: str, start: int, data: torch.Tensor | None, final: bool,
             first: FirstToken | None, state: torch.Tensor | None = None) -> Future:
        """Write pushed blocks (``[n, layers, 2, block_size, heads, dim]``) into the reservation;
        ``state``: a hybrid model's recurrent state (final push)."""
        return self.post(lambda: self.transfers.fill(transfer_id, start, data, final, first, time.monotonic(),
                                                     state))

    def cancel(self, transfer_id: str) -> None:
        self.post(lambda: self.transfers.cancel(transfer_id))

    def drop_owner(self, owner: object) -> None:
        """The connection ``owner`` closed; free the incomplete reservations it last carried."""
        self.post(lambda: self.transfers.drop_owner(owner))

    # ---- step-thread hooks ----------------------------------------------------------------------
    def claim(self, req: Request, claim: DecodeClaim, now: float) -> TokenLogprob | None:
        """Start ``req`` from the completed transfer ``claim`` names: its blocks, its sampler state
        and its first token (appended) come from the prefill side; returns that token's logprob
        entry if the request asks for logprobs. ``claim.claimed`` resolves with the reservation or
        fails with the ``UnknownTransfer``/``TransferMismatch`` raised here (``req`` untouched)."""
        try:
            r = self.transfers.claim(claim.transfer_id, req.prompt_token_ids, req.request_id, req.kv_root)
        except HandoffError as e:
            if claim.claimed is not None:
                claim.claimed.set_exception(e)
            raise
        if claim.claimed is not None:
            claim.claimed.set_result(r)
        first = r.first
        assert first is not None  # claim() accepts complete transfers only
        if first.generator_state is not None and req.generator is not None:
            req.generator.set_state(torch.frombuffer(bytearray(first.generator_state), dtype=torch.uint8))
        req.num_computed_tokens = req.num_prompt_tokens
        req.num_cached_tokens = first.cached_tokens
        req.handoff_state = r.state  # written into the request's slot when it is admitted
        req.append_token(first.token_id)
        m = req.metrics
        m.first_scheduled_time = m.first_token_time = m.last_token_time = now
        if req.params.logprobs is None or first.logprob is None:
            return None
        return TokenLogprob(first.token_id, first.logprob, [tuple(t) for t in first.top_logprobs])

    def expire(self, now: float) -> list[str]:
        """Free reservations past their deadline; returns their transfer ids."""
        return self.transfers.expire(now) if len(self.transfers) else []

    @property
    def timeouts(self) -> int:
        return self.transfers.expired

    @property
    def reserved_blocks(self) -> int:
        return self.transfers.reserved_blocks

    def check_integrity(self) -> None:
        self.transfers.check_integrity()
