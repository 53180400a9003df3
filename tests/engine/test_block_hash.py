"""Block hash chain: the encoding is a contract with the router and cache nodes."""

from __future__ import annotations

import hashlib
import struct

import pytest

from kvmesh.engine.block_hash import ROOT_HASH, extra_key, hash_block, hash_blocks

VECTOR_TOKENS = [1, 2, 3, 4, 5, 6, 7, 8, 70000, 4294967295, 9, 10, 11]
VECTOR_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
# Golden values: another implementation of the chain must reproduce these digests.
GOLDEN_ROOT = "06ffdb8401d66ad89aaa17b89fc7cd08a872f47bef9e0388e323d9dfa094f6dc"
GOLDEN_CHAIN = [
    "df5b16aff564d77cc9276e983cb05699e063c9a53b7c9c79ce057d20f3ceda51",
    "ba3125becd0fdc4415ec3094bf778156d6b88f4a9c0f231b0620f004527fc0c2",
    "a8390ef8ad9307fa212c9d79a3b210a283e77ae0e8f1c72d70929224029baef5",
]


def _reference_extra(fields: list[str | None]) -> bytes:
    out = b"kvmesh-extra-v1"
    for f in fields:
        if f is None:
            out += b"\x00"
        else:
            raw = f.encode()
            out += b"\x01" + len(raw).to_bytes(4, "little") + raw
    return out


def _reference_chain(tokens: list[int], block_size: int, extra: bytes) -> list[str]:
    """The documented encoding, written out independently of the module."""
    parent = hashlib.sha256(b"kvmesh-root-v1").digest()
    out = []
    for i in range(len(tokens) // block_size):
        blk = tokens[i * block_size:(i + 1) * block_size]
        msg = parent + struct.pack("<I", len(blk)) + b"".join(t.to_bytes(4, "little") for t in blk) + extra
        parent = hashlib.sha256(msg).digest()
        out.append(parent.hex())
    return out


def test_test_vector_matches_independent_encoding_and_golden_digests():
    extra = extra_key(VECTOR_MODEL, "bfloat16", cache_salt="tenant-a")
    assert extra == _reference_extra([VECTOR_MODEL, "bfloat16", None, "tenant-a"])
    assert ROOT_HASH.hex() == GOLDEN_ROOT
    got = [h.hex() for h in hash_blocks(VECTOR_TOKENS, 4, extra)]
    assert got == _reference_chain(VECTOR_TOKENS, 4, extra)
    assert got == GOLDEN_CHAIN
    assert all(len(h) == 32 for h in hash_blocks(VECTOR_TOKENS, 4, extra))


def test_partial_trailing_block_has_no_hash():
    extra = extra_key("m", "bfloat16")
    assert hash_blocks([1, 2, 3], 4, extra) == []
    assert len(hash_blocks(list(range(7)), 4, extra)) == 1
    assert len(hash_blocks(list(range(8)), 4, extra)) == 2
    assert len(hash_blocks(list(range(5)), 1, extra)) == 5


def test_extra_key_separates_what_changes_kv():
    base = extra_key("m", "bfloat16")
    variants = [extra_key("m2", "bfloat16"), extra_key("m", "float16"),
                extra_key("m", "bfloat16", lora="a"), extra_key("m", "bfloat16", cache_salt="s"),
                extra_key("m", "bfloat16", lora="s")]
    assert len({base, *variants}) == 6
    # Absent lora/salt may be spelled None or "".
    assert extra_key("m", "bfloat16", lora="", cache_salt="") == base
    # Length prefixes keep field boundaries unambiguous.
    assert extra_key("ab", "c") != extra_key("a", "bc")
    tokens = list(range(8))
    assert hash_blocks(tokens, 4, base)[0] != hash_blocks(tokens, 4, variants[3])[0]


def test_extra_key_rejects_empty_identity():
    with pytest.raises(ValueError, match="model_id"):
        extra_key("", "bfloat16")
    with pytest.raises(ValueError, match="dtype"):
        extra_key("m", "")


def test_chain_depends_on_whole_prefix():
    extra = extra_key("m", "bfloat16")
    a = hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4, extra)
    b = hash_blocks([9, 2, 3, 4, 5, 6, 7, 8], 4, extra)
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different prefix
    assert hash_block(ROOT_HASH, [5, 6, 7, 8], extra) != a[1]


def test_block_size_is_part_of_the_encoding():
    extra = extra_key("m", "bfloat16")
    # [1,2] then [3,4] with bs 2 must not collide with anything of bs 4.
    assert set(hash_blocks([1, 2, 3, 4], 2, extra)).isdisjoint(hash_blocks([1, 2, 3, 4], 4, extra))


def test_incremental_known_prefix_matches_full_recompute():
    extra = extra_key("m", "bfloat16")
    tokens = list(range(100, 140))
    full = hash_blocks(tokens, 4, extra)
    partial = hash_blocks(tokens[:13], 4, extra)
    assert len(partial) == 3
    grown = hash_blocks(tokens, 4, extra, known=partial)
    assert grown == full
    assert partial == full[:3]  # the input list is not mutated


def test_known_hashes_are_reused_not_recomputed():
    extra = extra_key("m", "bfloat16")
    fake = [b"\x01" * 32]
    out = hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4, extra, known=fake)
    assert out[0] == fake[0]
    assert out[1] == hash_block(fake[0], [5, 6, 7, 8], extra)


def test_start_block_with_parent():
    extra = extra_key("m", "bfloat16")
    tokens = list(range(24))
    full = hash_blocks(tokens, 4, extra)
    assert hash_blocks(tokens, 4, extra, parent=full[1], start_block=2) == full[2:]
    assert hash_blocks(tokens, 4, extra, parent=full[1], start_block=2, known=full[2:4]) == full[2:]


def test_known_longer_than_sequence_is_rejected():
    extra = extra_key("m", "bfloat16")
    known = hash_blocks(list(range(8)), 4, extra)
    with pytest.raises(ValueError, match="known hashes"):
        hash_blocks(list(range(5)), 4, extra, known=known)


@pytest.mark.parametrize("bad", [-1, 2**32, 1.5])
def test_token_ids_must_fit_uint32(bad):
    with pytest.raises(ValueError, match="token ids"):
        hash_block(ROOT_HASH, [1, bad], b"")


def test_bad_arguments():
    with pytest.raises(ValueError, match="parent hash"):
        hash_block(b"short", [1], b"")
    with pytest.raises(ValueError, match="block_size"):
        hash_blocks([1, 2], 0, b"")
    with pytest.raises(ValueError, match="start_block"):
        hash_blocks([1, 2], 1, b"", start_block=-1)
