"""Block header: wire round trip, geometry validation, and every mismatch rejected by name."""

from __future__ import annotations

import msgspec
import pytest

from kvmesh.engine.transfer import protocol
from kvmesh.engine.transfer.errors import HeaderMismatch
from kvmesh.engine.transfer.header import (HEADER_VERSION, BlockBatch, BlockHeader, BufferSpec, check_batch,
                                           check_header, check_layout, kv_layout, validate_layout)

from tests.support.kv_blocks import chain, layout


def test_kv_layout_geometry():
    lay = layout("bfloat16", block_size=16, layers=30, heads=3, head_dim=64)
    assert [b.name for b in lay.buffers[:4]] == ["k.0", "v.0", "k.1", "v.1"]
    assert len(lay.buffers) == 60
    # The default model's KV: 23,040 bytes per token.
    assert lay.nbytes == 16 * 23_040
    assert lay.version == HEADER_VERSION
    offs = list(lay.offsets())
    assert offs[0] == ("k.0", 0, 16 * 3 * 64 * 2) and offs[-1][2] == lay.nbytes


def test_header_round_trip_through_protocol():
    lay = layout("float32")
    hashes = chain(lay, 3)
    batch = BlockBatch(lay, hashes, [None, hashes[0], hashes[1]])
    for msg in (protocol.PutOffer(batch), protocol.Get(lay, hashes), protocol.GetReply(batch),
                protocol.GetReply(None), protocol.PutDone([protocol.STORED, protocol.EXISTS])):
        assert protocol.decode(protocol.encode(msg)) == msg
    back = protocol.decode(protocol.encode(protocol.PutOffer(batch))).batch
    assert back.headers() == [BlockHeader(lay, h, p) for h, p in zip(hashes, [None, *hashes[:2]])]


def test_undecodable_message_raises():
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        protocol.decode(b"\x93\xa3bad")


_CHANGES = {
    "version": HEADER_VERSION + 1,
    "extra_key": b"another model",
    "dtype": "float16",
    "block_size": 8,
    "num_layers": 3,
    "num_kv_heads": 1,
    "head_dim": 16,
    "buffers": (BufferSpec("k.0", 1),),
}


@pytest.mark.parametrize("field", list(_CHANGES))
def test_every_layout_mismatch_names_its_field(field):
    lay = layout()
    other = msgspec.structs.replace(lay, **{field: _CHANGES[field]})
    with pytest.raises(HeaderMismatch) as e:
        check_layout(lay, other)
    assert e.value.field == field
    assert repr(field) in str(e.value)


def test_validate_layout_rejects_inconsistent_geometry():
    lay = layout()
    with pytest.raises(HeaderMismatch, match="version") as e:
        validate_layout(msgspec.structs.replace(lay, version=99))
    assert e.value.field == "version"
    bad = msgspec.structs.replace(lay, buffers=(BufferSpec("k.0", 7),) + lay.buffers[1:])
    with pytest.raises(HeaderMismatch) as e:
        validate_layout(bad)
    assert e.value.field == "buffers"
    with pytest.raises(HeaderMismatch) as e:
        validate_layout(msgspec.structs.replace(lay, dtype="int4"))
    assert e.value.field == "dtype"
    dup = msgspec.structs.replace(lay, buffers=lay.buffers + (lay.buffers[0],))
    with pytest.raises(HeaderMismatch, match="buffers"):
        validate_layout(dup)


def test_extra_buffers_have_room():
    lay = layout()
    more = kv_layout(lay.extra_key, lay.dtype, lay.block_size, lay.num_layers, lay.num_kv_heads, lay.head_dim,
                     extra_buffers=[BufferSpec("draft.k.0", 96), BufferSpec("state.0", 40)])
    validate_layout(more)
    assert more.nbytes == lay.nbytes + 136


def test_check_header_hashes():
    lay = layout()
    h = chain(lay, 2)
    hdr = BlockHeader(lay, h[1], h[0])
    check_header(lay, hdr, block_hash=h[1], parent_hash=h[0])
    with pytest.raises(HeaderMismatch) as e:
        check_header(lay, hdr, block_hash=h[0])
    assert e.value.field == "block_hash"
    with pytest.raises(HeaderMismatch) as e:
        check_header(lay, hdr, parent_hash=None)
    assert e.value.field == "parent_hash"
    with pytest.raises(HeaderMismatch) as e:
        check_header(lay, BlockHeader(lay, b"short", None))
    assert e.value.field == "block_hash"
    with pytest.raises(HeaderMismatch) as e:
        check_header(layout(dtype="float32"), hdr)
    assert e.value.field == "extra_key"  # the extra key covers the dtype, and comes first


def test_batch_needs_one_layout_and_valid_hashes():
    a, b = layout(), layout(head_dim=16)
    h = chain(a, 2)
    with pytest.raises(HeaderMismatch) as e:
        BlockBatch.of([BlockHeader(a, h[0], None), BlockHeader(b, h[1], h[0])])
    assert e.value.field == "head_dim"
    with pytest.raises(HeaderMismatch) as e:
        check_batch(BlockBatch(a, [h[0], b"x" * 31], [None, h[0]]))
    assert e.value.field == "block_hash"
    with pytest.raises(HeaderMismatch) as e:
        check_batch(BlockBatch(a, h, [None, h[0]]), expected=b)
    assert e.value.field == "head_dim"
