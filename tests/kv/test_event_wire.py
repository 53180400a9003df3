"""The KV event wire layout: round trips, and decoding with structs written from the published layout.

The independent structs below follow the layout as documented (vLLM's KV event records), not
kvmesh's own classes, so a change that breaks third-party readers fails here.
"""

from __future__ import annotations

import msgspec
import pytest

from kvmesh.engine.kv import event_wire as w
from kvmesh.engine.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventRecord,
    KVSnapshot,
    checkpoint_removed,
    checkpoint_stored,
)

H = [bytes([i]) * 32 for i in range(1, 5)]
EVENTS = [
    BlockStored(H[:2], None, list(range(8)), 4),
    BlockStored([H[2]], H[1], [7, 8, 9, 10], 4, "cpu"),
    BlockStored([H[3]], H[0], [1, 2, 3, 4], 4, "remote"),
    BlockRemoved([H[0], H[2]]),
    BlockRemoved([H[3]], "remote"),
    AllBlocksCleared(),
    AllBlocksCleared("cpu"),
]


# ---- structs written from the layout -------------------------------------------------------------


class Stored(msgspec.Struct, array_like=True, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class Removed(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None


class Cleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


class Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Stored | Removed | Cleared]
    data_parallel_rank: int | None


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: f"{type(e).__name__}-{e.tier}")
def test_round_trip(event):
    assert w.to_internal(w.from_internal(event)) == event
    seq, payload = w.encode_record(KVEventRecord(42, "e", 123.5, event))
    assert w.seq_from_bytes(seq) == 42
    batch = w.decode_payload(payload)
    assert batch.ts == 123.5 and [w.to_internal(e) for e in batch.events] == [event]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: f"{type(e).__name__}-{e.tier}")
def test_independent_structs_decode_what_kvmesh_sends(event):
    _, payload = w.encode_record(KVEventRecord(1, "e", 5.0, event))
    batch = msgspec.msgpack.decode(payload, type=Batch)
    assert batch.ts == 5.0 and len(batch.events) == 1
    got = batch.events[0]
    if isinstance(event, BlockStored):
        assert got == Stored(event.block_hashes, event.parent_hash, event.token_ids, 4, None, event.tier, None)
    elif isinstance(event, BlockRemoved):
        assert got == Removed(event.block_hashes, event.tier)
    else:
        assert isinstance(got, Cleared)  # vLLM's record has no fields; kvmesh's trailing medium is ignored


def test_the_raw_layout_is_tagged_arrays():
    """Every field vLLM sends is there (nil where kvmesh has no value): strict decoders such as
    llm-d's refuse arrays of another length."""
    _, payload = w.encode_record(KVEventRecord(1, "e", 2.0, EVENTS[1]))
    assert msgspec.msgpack.decode(payload) == [
        2.0, [["BlockStored", [H[2]], H[1], [7, 8, 9, 10], 4, None, "cpu", None]], None]
    _, payload = w.encode_record(KVEventRecord(2, "e", 2.0, AllBlocksCleared()))
    assert msgspec.msgpack.decode(payload) == [2.0, [["AllBlocksCleared"]], None]  # vLLM's record: gpu
    _, payload = w.encode_record(KVEventRecord(3, "e", 2.0, AllBlocksCleared("cpu")))
    assert msgspec.msgpack.decode(payload) == [2.0, [["AllBlocksCleared", "cpu"]], None]


def test_kvmesh_decodes_what_a_vllm_publisher_sends():
    # vLLM engines may send 64-bit int hashes, several events per batch, and no medium; older ones
    # send neither data_parallel_rank nor lora_name.
    seven, minus3 = (7).to_bytes(32, "big"), (-3).to_bytes(32, "big", signed=True)
    want = [BlockStored([seven, minus3], None, list(range(8)), 4, "gpu"), BlockRemoved([seven], "gpu"),
            AllBlocksCleared("gpu")]
    for payload in (
            msgspec.msgpack.encode(Batch(1.0, [Stored([7, -3], None, list(range(8)), 4, None, None, None),
                                               Removed([7], "GPU"), Cleared()], 0)),
            msgspec.msgpack.encode([1.0, [["BlockStored", [7, -3], None, list(range(8)), 4, None, None],
                                          ["BlockRemoved", [7], "GPU"], ["AllBlocksCleared"]]])):
        assert [w.to_internal(e) for e in w.decode_payload(payload).events] == want


CHECKPOINTS = [checkpoint_stored(H[:2], 4), checkpoint_removed([H[0]]), checkpoint_stored([H[3]], 4, "cpu"),
               BlockStored([H[1]], H[0], [1, 2, 3, 4], 4, "state-gpu")]


@pytest.mark.parametrize("event", CHECKPOINTS, ids=lambda e: f"{type(e).__name__}-{e.tier}")
def test_checkpoint_records_are_vllm_records_of_their_own_medium(event):
    """A checkpoint record is a BlockStored/BlockRemoved with a ``state-*`` medium: vLLM's layout
    decodes it unchanged (a reader that ignores the medium still decodes the batch), and a
    BlockStored never carries token ids, even when the stream sends them for KV blocks."""
    _, payload = w.encode_record(KVEventRecord(1, "e", 5.0, event), token_ids=True)
    got = msgspec.msgpack.decode(payload, type=Batch).events[0]
    assert got.medium == event.tier and got.medium.startswith("state-")
    assert got.block_hashes == event.block_hashes
    if isinstance(event, BlockStored):
        assert isinstance(got, Stored) and got.token_ids == [] and got.block_size == 4
        assert w.to_internal(w.decode_payload(payload).events[0]) == BlockStored(
            event.block_hashes, event.parent_hash, [], 4, event.tier)
    else:
        assert isinstance(got, Removed) and w.to_internal(w.decode_payload(payload).events[0]) == event
    snap = KVSnapshot(3, "e", {"gpu": frozenset(H[:2]), "state-gpu": frozenset([H[1]])})
    assert w.snapshot_from_json(msgspec.json.decode(msgspec.json.encode(w.snapshot_to_json(snap)))) == snap


def test_malformed_input_is_a_wire_format_error():
    with pytest.raises(w.WireFormatError):
        w.decode_payload(b"\x01\x02")
    with pytest.raises(w.WireFormatError, match="medium"):
        w.to_internal(w.WireBlockRemoved([H[0]], "tape"))
    with pytest.raises(w.WireFormatError, match="8 bytes"):
        w.seq_from_bytes(b"\x00")


def test_seq_frames_topics_and_snapshots():
    assert w.seq_from_bytes(w.seq_bytes(2**40 + 1)) == 2**40 + 1
    assert w.seq_from_bytes(w.REPLAY_END) == -1
    assert w.engine_of_topic(w.topic_for("engine-9")) == "engine-9"
    assert w.engine_of_topic(b"") == "" and w.engine_of_topic(b"kv-events") == ""
    snap = KVSnapshot(17, "engine-9", {"gpu": frozenset(H[:2]), "cpu": frozenset(), "remote": frozenset([H[3]])})
    assert w.snapshot_from_json(msgspec.json.decode(msgspec.json.encode(w.snapshot_to_json(snap)))) == snap
    with pytest.raises(w.WireFormatError, match="format"):
        w.snapshot_from_json({"format": "other"})
    with pytest.raises(w.WireFormatError, match="malformed"):
        w.snapshot_from_json({"format": w.SNAPSHOT_FORMAT, "seq": 1})
