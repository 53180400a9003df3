"""Block hash chain: the content address of a KV block, shared by engines, router and cache nodes.

Every party that names KV blocks (engines when they cache or publish, the router when it
scores a prompt, cache nodes when they store or serve) must compute identical hashes, so the
encoding below is a wire contract. Version it (``ROOT_HASH`` seed, ``EXTRA_MAGIC``) rather
than changing it in place.

Encoding (version 1)
--------------------
All integers are unsigned little-endian. ``sha256`` is SHA-256 (FIPS 180-4), digest 32 bytes.

* Root seed::

      ROOT_HASH = sha256(b"kvmesh-root-v1")

* Extra key (what makes the KV of identical tokens differ)::

      extra = b"kvmesh-extra-v1" || field(model_id) || field(dtype) || field(lora) || field(cache_salt)
      field(None) = 0x00
      field(s)    = 0x01 || uint32(len(utf8(s))) || utf8(s)

  ``lora`` and ``cache_salt`` treat the empty string exactly like ``None`` (both mean "absent"),
  so a caller that spells "no salt" as ``""`` and one that spells it ``None`` agree.
  ``model_id`` and ``dtype`` are encoded verbatim (no case folding); callers pass canonical
  names (``dtype`` as "bfloat16", "float16" or "float32").

* Chain root of a request (per-request tenant isolation, the API's ``cache_salt``)::

      root(None) = root("") = ROOT_HASH
      root(salt) = sha256(ROOT_HASH || b"kvmesh-salt-v1" || field(salt))

  A salted request's chain starts from its own root instead of ``ROOT_HASH``, so the salt
  enters the first block's hash and, through the chain, every later one: requests with
  different salts (or one salted and one not) never name a common block on any tier.

* Block ``i`` of a token sequence covers ``token_ids[i*B : (i+1)*B]`` for block size ``B``;
  only FULL blocks have a hash. With ``h_{-1}`` the request's chain root (``ROOT_HASH`` unsalted)::

      h_i = sha256(h_{i-1} || uint32(B) || uint32(t_0) || ... || uint32(t_{B-1}) || extra)

  The count field makes the token run self-delimiting, and ``h_{i-1}`` is always 32 bytes,
  so ``extra`` needs no length prefix: it is simply the rest of the message.

Token ids must fit in uint32 (0 <= t < 2**32); anything else is rejected rather than wrapped.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes
"""A 32-byte SHA-256 digest naming one full block together with its whole prefix."""

HASH_FUNCTION = "sha256"  # what /kv/info reports; a router or engine hashing otherwise names other blocks
HASH_LEN = 32
ROOT_HASH: BlockHash = hashlib.sha256(b"kvmesh-root-v1").digest()
EXTRA_MAGIC = b"kvmesh-extra-v1"
SALT_MAGIC = b"kvmesh-salt-v1"

_UINT32_MAX = 2**32 - 1


def _field(value: str | None) -> bytes:
    if value is None:
        return b"\x00"
    raw = value.encode("utf-8")
    return b"\x01" + struct.pack("<I", len(raw)) + raw


def extra_key(model_id: str, dtype: str, lora: str | None = None, cache_salt: str | None = None) -> bytes:
    """Canonical bytes of everything besides the tokens that changes a block's KV.

    Two engines produce interchangeable KV for the same tokens iff their extra keys are equal.
    """
    if not model_id:
        raise ValueError("extra_key: model_id must be a non-empty string (it separates caches of different models)")
    if not dtype:
        raise ValueError("extra_key: dtype must be a non-empty string such as 'bfloat16'")
    return (EXTRA_MAGIC + _field(model_id) + _field(dtype)
            + _field(lora or None) + _field(cache_salt or None))


def chain_root(cache_salt: str | None = None) -> BlockHash:
    """The hash a request's block chain starts from: ``ROOT_HASH`` without a salt (or with ``""``)."""
    if not cache_salt:
        return ROOT_HASH
    return hashlib.sha256(ROOT_HASH + SALT_MAGIC + _field(cache_salt)).digest()


def _encode_tokens(token_ids: Sequence[int]) -> bytes:
    try:
        return struct.pack(f"<I{len(token_ids)}I", len(token_ids), *token_ids)
    except struct.error:
        bad = next((t for t in token_ids if not (isinstance(t, int) and 0 <= t <= _UINT32_MAX)), None)
        raise ValueError(f"token ids must be integers in [0, 2**32); got {bad!r}") from None


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra: bytes) -> BlockHash:
    """Hash of one full block given its parent's hash (``ROOT_HASH`` for the first block)."""
    if len(parent) != HASH_LEN:
        raise ValueError(f"parent hash must be {HASH_LEN} bytes, got {len(parent)}")
    h = hashlib.sha256(parent)
    h.update(_encode_tokens(token_ids))
    h.update(extra)
    return h.digest()


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra: bytes,
    parent: BlockHash = ROOT_HASH,
    start_block: int = 0,
    known: list[BlockHash] | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks ``start_block, start_block + 1, ...`` of ``token_ids``.

    ``token_ids`` is the whole sequence from position 0; a trailing partial block gets no hash.
    ``parent`` is the hash of block ``start_block - 1`` (``ROOT_HASH`` when ``start_block`` is 0).
    ``known``, when given, holds hashes already computed for the first blocks of the answer
    (blocks ``start_block .. start_block + len(known) - 1``); they are reused, not recomputed, so
    a caller that extends a sequence pays only for its new full blocks. The result always
    starts with a copy of ``known``; the inputs are never mutated.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if start_block < 0:
        raise ValueError(f"start_block must be >= 0, got {start_block}")
    num_full = len(token_ids) // block_size
    out = list(known) if known else []
    if start_block + len(out) > num_full:
        raise ValueError(
            f"{len(out)} known hashes from block {start_block} exceed the {num_full} full blocks of a "
            f"{len(token_ids)}-token sequence with block_size {block_size}; the token list does not "
            f"belong to these hashes")
    prev = out[-1] if out else parent
    for i in range(start_block + len(out), num_full):
        prev = hash_block(prev, token_ids[i * block_size:(i + 1) * block_size], extra)
        out.append(prev)
    return out


def max_hit_blocks(num_tokens: int, block_size: int, whole: bool = True) -> int:
    """The most full blocks of a ``num_tokens`` sequence a prefix hit may cover: every one with
    ``whole`` (a dense engine then runs only the last token again, for its logits, its KV already
    cached), else those before the last token (a hybrid engine, which resumes from a recurrent
    state and computes the last token from scratch). Engines and the router share this rule."""
    return max(0, (num_tokens if whole else num_tokens - 1) // block_size)


def hit_tokens(num_blocks: int, block_size: int, num_tokens: int, whole: bool = True) -> int:
    """Prompt tokens reported cached (and skipped) for ``num_blocks`` matched leading blocks: one
    token short of the sequence at most, since the last one always runs."""
    n = min(num_blocks, max_hit_blocks(num_tokens, block_size, whole)) * block_size
    return max(0, min(n, num_tokens - 1))
