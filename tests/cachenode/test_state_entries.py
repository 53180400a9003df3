"""Recurrent-state checkpoints as entries of their own: the header checks and the store.

Real: the header module and ``BlockStore`` as the cache node runs them (no I/O involved).
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from kvmesh.engine.cachenode.store import BlockStore
from kvmesh.engine.kv.events import BlockRemoved, BlockStored, apply_event
from kvmesh.engine.transfer.errors import HeaderMismatch
from kvmesh.engine.transfer.header import (KIND_STATE, BlockHeader, BufferSpec, StateBufferSpec, check_layout,
                                           state_layout, validate_layout)

from tests.support.kv_blocks import blocks, chain, layout

KV = layout()
SPECS = [StateBufferSpec("conv.0", "float16", (12, 3)), StateBufferSpec("conv.2", "float16", (12, 3)),
         StateBufferSpec("ssm.0", "float32", (2, 4, 4)), StateBufferSpec("ssm.2", "float32", (2, 4, 4))]
ST = state_layout(KV, SPECS)


def test_state_layout_describes_each_buffer():
    assert ST.kind == KIND_STATE and ST.extra_key == KV.extra_key and ST.block_size == KV.block_size
    assert [(b.name, b.nbytes) for b in ST.buffers] == [("conv.0", 72), ("conv.2", 72), ("ssm.0", 128), ("ssm.2", 128)]
    assert ST.nbytes == 400
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(ST), type=type(ST)) == ST


def test_a_differing_buffer_is_named_field_by_field():
    other = list(SPECS)
    other[2] = StateBufferSpec("ssm.0", "float32", (2, 4, 5))
    with pytest.raises(HeaderMismatch) as e:
        check_layout(ST, state_layout(KV, other))
    assert e.value.field == "state[ssm.0]"
    other[2] = StateBufferSpec("ssm.0", "bfloat16", (2, 4, 4))
    with pytest.raises(HeaderMismatch) as e:
        check_layout(ST, state_layout(KV, other))
    assert e.value.field == "state[ssm.0]"
    with pytest.raises(HeaderMismatch) as e:
        check_layout(KV, ST)
    assert e.value.field == "kind"


def test_inconsistent_state_layouts_are_invalid():
    lying = msgspec.structs.replace(ST, buffers=(*ST.buffers[:-1], BufferSpec("ssm.2", 127)))
    with pytest.raises(HeaderMismatch, match="state specs"):
        validate_layout(lying)
    with pytest.raises(HeaderMismatch):
        validate_layout(msgspec.structs.replace(ST, state=()))
    with pytest.raises(HeaderMismatch):
        validate_layout(msgspec.structs.replace(KV, kind="other"))


def test_store_keeps_blocks_and_checkpoints_of_one_hash_apart():
    events = []
    s = BlockStore(1 << 20, on_event=events.append)
    blks, _ = blocks(KV, 3)
    for b in blks:
        s.put(b.header, b.data)
    hashes = [b.header.block_hash for b in blks]
    ck = np.arange(ST.nbytes, dtype=np.uint8)
    assert s.put(BlockHeader(ST, hashes[1], None), ck) == "stored"
    assert s.lookup(hashes) == 3 and s.num_blocks == 4
    # A checkpoint get answers the first held hash of the candidates (asked deepest first).
    got = s.get(ST, hashes[::-1])
    assert [g.header.block_hash for g in got] == [hashes[1]] and np.array_equal(got[0].data, ck)
    assert s.get(ST, [hashes[2], hashes[0]]) == []
    assert len(s.get(KV, hashes)) == 3  # the KV blocks are untouched by the checkpoint
    # The three KV blocks in the remote tier, the checkpoint in a medium of its own.
    assert [(e.tier, e.block_hashes) for e in events] == [("remote", [h]) for h in hashes] + [("state-remote", [hashes[1]])]
    s.check_integrity()


def test_store_refuses_a_checkpoint_of_another_layout():
    s = BlockStore(1 << 20)
    h = chain(KV, 1)[0]
    s.put(BlockHeader(ST, h, None), np.zeros(ST.nbytes, np.uint8))
    other = state_layout(KV, [*SPECS[:3], StateBufferSpec("ssm.2", "float32", (2, 4, 8))])
    with pytest.raises(HeaderMismatch) as e:
        s.get(other, [h])
    assert e.value.field == "state[ssm.2]"
    with pytest.raises(HeaderMismatch):
        s.put(BlockHeader(other, h, None), np.zeros(other.nbytes, np.uint8))
    assert s.stats.rejected_headers == 2
    s.check_integrity()


def test_eviction_spans_both_kinds_and_each_is_announced_in_its_medium():
    events = []
    s = BlockStore(KV.nbytes * 2 + ST.nbytes, on_event=events.append)
    blks, _ = blocks(KV, 3)
    s.put(BlockHeader(ST, blks[0].header.block_hash, None), np.zeros(ST.nbytes, np.uint8))
    for b in blks:
        s.put(b.header, b.data)
    assert s.used_bytes <= s.capacity_bytes and s.stats.evictions >= 1
    held: dict[str, set[bytes]] = {}
    for e in events:
        apply_event(held, e)
    # Replaying the node's events gives exactly what it holds, per kind.
    assert held.get("remote", set()) == {h for h in s.lru_order() if isinstance(h, bytes)}
    assert held.get("state-remote", set()) == {h[1] for h in s.lru_order() if isinstance(h, tuple)}
    removed = [h for e in events if isinstance(e, BlockRemoved) and e.tier == "state-remote" for h in e.block_hashes]
    assert removed == [blks[0].header.block_hash]  # the checkpoint was the LRU entry
    stored = [h for e in events if isinstance(e, BlockStored) and e.tier == "remote" for h in e.block_hashes]
    assert stored == [b.header.block_hash for b in blks]
    s.check_integrity()
