"""Per-request KV block tables on top of a BlockPool, with prefix caching.

A request's life, as the scheduler drives it::

    blocks, n = kv.get_computed_blocks(rid, tokens)          # prefix hits; nothing reserved yet
    new = kv.allocate_slots(rid, tokens, num_new, blocks, n)  # None: does not fit, nothing changed
    ... model computes KV for tokens[n : n + num_new] ...
    kv.cache_blocks(rid, tokens, n + num_new)                # publish newly full blocks
    ... each later step: allocate_slots(rid, tokens, k, num_computed_tokens=computed) ...
    kv.free(rid)                                              # finished, aborted or preempted

Invariants (``check_integrity``): the pool's own; every block a request holds has
``ref_cnt >= 1``; for every block, ``ref_cnt`` equals the number of requests holding it; the
first ``num_cached_blocks`` blocks of a request are hashed with the request's own chain hashes
(or unhashed, when an identical block was cached first).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from kvmesh.engine.block_hash import ROOT_HASH, BlockHash, hash_block, max_hit_blocks
from .block_pool import BlockPool, EvictHandler, KVBlock, KVIntegrityError
from .events import TIER_GPU, KVEventHandler


@dataclass
class PrefixCacheStats:
    """Cumulative prefix-cache lookups, in tokens, one per request admission.

    ``queries``/``hits`` count each request's first admission only, so ``hit_rate`` is the
    share of prompt tokens served from the cache. Re-admissions after preemption (which look up
    prompt and generated tokens again) go to ``preempted_queries``/``preempted_hits``.
    """

    queries: int = 0
    hits: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class CachedSegment:
    """Consecutive blocks of one request that ``cache_blocks`` just registered (now full and
    immutable): ``block_ids[i]`` holds ``block_hashes[i]``; ``parent_hash`` precedes the first."""

    block_ids: list[int]
    block_hashes: list[BlockHash]
    parent_hash: BlockHash | None
    request_id: str = ""


@dataclass
class RequestKV:
    """KV state of one request.

    ``block_hashes[i]`` is the chain hash of the request's full block ``i`` (computed lazily,
    only as far as needed). ``blocks[:num_cached_blocks]`` are registered in the cache (or were
    prefix hits), so they are immutable from here on.
    """

    blocks: list[KVBlock] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_cached_blocks: int = 0
    root: BlockHash = ROOT_HASH
    """What block 0's hash chains from: ``block_hash.chain_root(cache_salt)`` of the request."""


class KVCacheManager:
    """Maps request ids to block tables in one BlockPool; costs O(blocks touched) per call."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, extra: bytes,
                 on_event: KVEventHandler | None = None, tier: str = TIER_GPU,
                 on_evict: EvictHandler | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.extra = extra
        self.pool = BlockPool(num_blocks, enable_caching, on_event, tier=tier, block_size=block_size,
                              on_evict=on_evict)
        self.requests: dict[str, RequestKV] = {}
        self._stats = PrefixCacheStats()

    # ---------------------------------------------------------------- helpers
    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    def _ensure_hashes(self, state: RequestKV, token_ids: Sequence[int], num_blocks: int) -> None:
        """Extend the request's hash chain to its first ``num_blocks`` full blocks (new ones only)."""
        hashes, bs = state.block_hashes, self.block_size
        if num_blocks * bs > len(token_ids):
            raise ValueError(f"{num_blocks} full blocks need {num_blocks * bs} tokens, "
                             f"the request has {len(token_ids)}")
        prev = hashes[-1] if hashes else state.root
        for i in range(len(hashes), num_blocks):
            prev = hash_block(prev, token_ids[i * bs:(i + 1) * bs], self.extra)
            hashes.append(prev)

    # ------------------------------------------------------------- scheduling
    def max_hit_blocks(self, num_tokens: int, whole: bool = False) -> int:
        """``block_hash.max_hit_blocks`` at this manager's block size: with ``whole`` the step
        recomputes only a fully hit request's last token (``ScheduledSeq.num_cached_new``)."""
        return max_hit_blocks(num_tokens, self.block_size, whole)

    def get_computed_blocks(self, request_id: str, token_ids: Sequence[int],
                            root: BlockHash = ROOT_HASH, whole: bool = False) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of the request, as (blocks, num_computed_tokens).

        ``root`` (here, in ``allocate_slots`` and ``extend_chain``) is the request's chain root,
        used when its KV state is created: pass the same one on every call for a request.

        Leaves at least one token to compute, so the model still produces logits, unless
        ``whole`` (see ``max_hit_blocks``): then num_computed_tokens may equal len(token_ids).
        Takes no references: pass the result to ``allocate_slots`` in the same scheduling step.
        Counts nothing: a blocked request is looked up again every step, so the caller reports
        the lookup that led to an admission with ``record_prefix_lookup``.
        """
        if not self.enable_caching or not token_ids:
            return [], 0
        state = self.requests.setdefault(request_id, RequestKV(root=root))
        max_blocks = self.max_hit_blocks(len(token_ids), whole)
        self._ensure_hashes(state, token_ids, max_blocks)
        hits: list[KVBlock] = []
        for h in state.block_hashes[:max_blocks]:
            b = self.pool.get_cached_block(h)
            if b is None:
                break
            hits.append(b)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int, preempted: bool = False) -> None:
        """Count one admitted request's lookup (see PrefixCacheStats); a no-op without caching."""
        if not self.enable_caching:
            return
        if preempted:
            self._stats.preempted_queries += num_query_tokens
            self._stats.preempted_hits += num_hit_tokens
        else:
            self._stats.queries += num_query_tokens
            self._stats.hits += num_hit_tokens

    def allocate_slots(self, request_id: str, token_ids: Sequence[int], num_new_tokens: int,
                       new_computed_blocks: Sequence[KVBlock] = (),
                       num_computed_tokens: int = 0, root: BlockHash = ROOT_HASH,
                       spare_blocks: int = 0) -> list[KVBlock] | None:
        """Make the request own blocks for ``num_computed_tokens + num_new_tokens`` tokens.

        ``num_computed_tokens`` counts tokens whose KV already exists: on the first call the
        prefix-hit tokens from ``get_computed_blocks`` (with those blocks as
        ``new_computed_blocks``), on later calls the request's running count. Returns the newly
        allocated blocks, or None, with nothing changed, if the pool cannot supply them. A hit
        block sitting in the free queue is not available for allocation once taken, so it is
        subtracted from the free count before admitting. ``spare_blocks``: also None unless that
        many blocks stay free afterwards (the scheduler's admission reserve).
        """
        if num_new_tokens < 0 or num_computed_tokens < 0:
            raise ValueError(f"token counts must be >= 0 (new {num_new_tokens}, computed {num_computed_tokens})")
        state = self.requests.get(request_id)
        if new_computed_blocks:
            if state is not None and state.blocks:
                raise ValueError(f"request {request_id!r} already holds blocks; prefix hits are only "
                                 f"accepted on its first allocation")
            if num_computed_tokens < len(new_computed_blocks) * self.block_size:
                raise ValueError(f"{len(new_computed_blocks)} hit blocks cover "
                                 f"{len(new_computed_blocks) * self.block_size} tokens but "
                                 f"num_computed_tokens is {num_computed_tokens}")
            state = state or RequestKV(root=root)
            self._ensure_hashes(state, token_ids, len(new_computed_blocks))
            for i, b in enumerate(new_computed_blocks):
                if b.block_hash != state.block_hashes[i]:
                    raise ValueError(f"hit block {b.block_id} at position {i} no longer holds this request's "
                                     f"prefix (evicted since get_computed_blocks?); redo the lookup")
        elif state is not None and num_computed_tokens < state.num_cached_blocks * self.block_size:
            raise ValueError(f"request {request_id!r} has {state.num_cached_blocks} cached blocks "
                             f"but num_computed_tokens is {num_computed_tokens}; pass the request's "
                             f"running computed-token count on every call")
        held = len(state.blocks) if state is not None else 0
        need = max(0, self.num_blocks_for(num_computed_tokens + num_new_tokens) - held - len(new_computed_blocks))
        taken_from_free = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if need + max(0, spare_blocks) > self.pool.num_free_blocks - taken_from_free:
            return None
        if state is None:
            state = RequestKV(root=root)
        self.requests[request_id] = state
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            state.blocks.extend(new_computed_blocks)
            state.num_cached_blocks = len(new_computed_blocks)
        new = self.pool.allocate(need)
        state.blocks.extend(new)
        return new

    def cache_blocks(self, request_id: str, token_ids: Sequence[int],
                     num_computed_tokens: int) -> CachedSegment | None:
        """Register the request's blocks that became full once ``num_computed_tokens`` tokens
        have KV (``token_ids``: prompt + outputs so far). Hashing continues from the request's
        last known hash, so a decoding request pays only at block boundaries. Returns the blocks
        that became full here (None if none), e.g. for a write-through to a lower tier."""
        if not self.enable_caching:
            return None
        state = self.requests.get(request_id)
        if state is None:
            raise KeyError(f"cache_blocks: unknown request {request_id!r} (allocate_slots first)")
        num_full = min(num_computed_tokens // self.block_size, len(state.blocks))
        start = state.num_cached_blocks
        if num_full <= start:
            return None
        self._ensure_hashes(state, token_ids, num_full)
        bs = self.block_size
        parent = state.block_hashes[start - 1] if start else None
        blocks, hashes = state.blocks[start:num_full], state.block_hashes[start:num_full]
        self.pool.cache_full_blocks(blocks, hashes, parent, token_ids[start * bs:num_full * bs])
        state.num_cached_blocks = num_full
        return CachedSegment([b.block_id for b in blocks], list(hashes), parent, request_id)

    def free(self, request_id: str) -> None:
        """Release the request's blocks (last block first) and forget it. Unknown ids are ignored.
        Call it for every request that called get_computed_blocks or allocate_slots."""
        state = self.requests.pop(request_id, None)
        if state is not None and state.blocks:
            self.pool.free(reversed(state.blocks))

    def rename(self, old_id: str, new_id: str) -> None:
        """Move ``old_id``'s blocks and hashes to ``new_id`` (a transferred request gets its
        engine id when it is claimed); the blocks keep their references."""
        if new_id in self.requests:
            raise ValueError(f"request {new_id!r} already holds KV state")
        state = self.requests.pop(old_id, None)
        if state is None:
            raise KeyError(f"rename: unknown request {old_id!r}")
        self.requests[new_id] = state

    def extend_chain(self, request_id: str, token_ids: Sequence[int], num_blocks: int,
                     root: BlockHash = ROOT_HASH) -> list[BlockHash]:
        """The request's chain hashes of its first ``num_blocks`` full blocks (computed as needed,
        also without prefix caching: a KV transfer names its blocks by them)."""
        state = self.requests.setdefault(request_id, RequestKV(root=root))
        self._ensure_hashes(state, token_ids, num_blocks)
        return state.block_hashes[:num_blocks]

    # ---------------------------------------------------------------- queries
    def root(self, request_id: str) -> BlockHash:
        """The chain root the request's KV state was created with (``ROOT_HASH`` when it has none)."""
        state = self.requests.get(request_id)
        return state.root if state is not None else ROOT_HASH

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (empty for a request holding no blocks)."""
        state = self.requests.get(request_id)
        return [b.block_id for b in state.blocks] if state is not None else []

    def chain(self, request_id: str) -> list[BlockHash]:
        """The request's chain hashes computed so far (the live list: read, never modify)."""
        state = self.requests.get(request_id)
        return state.block_hashes if state is not None else []

    def block_hashes(self, request_id: str) -> list[BlockHash]:
        """The request's chain hashes computed so far (a copy)."""
        state = self.requests.get(request_id)
        return list(state.block_hashes) if state is not None else []

    def num_cached_blocks(self, request_id: str) -> int:
        state = self.requests.get(request_id)
        return state.num_cached_blocks if state is not None else 0

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks ``request_id`` owns now (0 for an unknown id)."""
        state = self.requests.get(request_id)
        return len(state.blocks) if state is not None else 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def prefix_stats(self) -> PrefixCacheStats:
        """Cumulative (queries, hits) in tokens, as a copy."""
        return replace(self._stats)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Pool invariants plus request/ref-count agreement (O(num_blocks); tests/debug)."""
        self.pool.check_integrity()
        errors: list[str] = []
        refs = [0] * self.pool.num_blocks
        for rid, state in self.requests.items():
            ids = [b.block_id for b in state.blocks]
            if len(set(ids)) != len(ids):
                errors.append(f"request {rid!r} holds a block twice: {ids}")
            for b in state.blocks:
                if self.pool.blocks[b.block_id] is not b:
                    errors.append(f"request {rid!r} holds foreign block {b.block_id}")
                    continue
                refs[b.block_id] += 1
                if b.ref_cnt < 1:
                    errors.append(f"request {rid!r} holds block {b.block_id} with ref_cnt {b.ref_cnt}")
            if state.num_cached_blocks > min(len(state.blocks), len(state.block_hashes)):
                errors.append(f"request {rid!r}: {state.num_cached_blocks} cached blocks but "
                              f"{len(state.blocks)} blocks, {len(state.block_hashes)} hashes")
                continue
            for i in range(state.num_cached_blocks):
                h = state.blocks[i].block_hash
                if h is not None and h != state.block_hashes[i]:
                    errors.append(f"request {rid!r}: cached block {i} (id {state.blocks[i].block_id}) "
                                  f"holds a hash from another sequence")
            for b in state.blocks[state.num_cached_blocks:]:
                if b.block_hash is not None:
                    errors.append(f"request {rid!r}: block {b.block_id} is still being written but is hashed")
        for b in self.pool.blocks:
            if refs[b.block_id] != b.ref_cnt:
                errors.append(f"block {b.block_id}: ref_cnt {b.ref_cnt} but {refs[b.block_id]} request references")
        if errors:
            raise KVIntegrityError("KV manager integrity violated: " + "; ".join(errors))
