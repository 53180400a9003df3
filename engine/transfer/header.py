"""The header every KV block carries on the wire, and the checks a receiver runs on it.

A block travels as named byte buffers (``k.0``, ``v.0``, ``k.1``, ... now; other names such as
draft-model KV or recurrent state can be added later without a new message type) laid out back
to back in header order. The header says what those bytes are:

* ``BlockLayout``: everything two processes must agree on before one may use the other's bytes
  (header version, extra key = model identity/dtype/LoRA/salt as hashed, dtype, block size, layer
  count, KV heads, head dim, and the buffers' names and sizes). One layout is shared by every
  block of a batch.
* ``BlockHeader``: a layout plus the block's own hash and its parent's hash.

An entry is of one of two kinds (``BlockLayout.kind``): ``kv`` (a KV block, as above) or
``state`` (a hybrid model's recurrent-state checkpoint at the end of the block with that hash:
one buffer per DeltaNet layer's conv state and one per recurrent state, each described by
``StateBufferSpec`` with its dtype and shape, so a receiver checks them field by field). The
geometry fields of a state layout still describe the model's attention KV (the same model's
blocks), ``dtype`` is the model dtype; ``state`` is empty for ``kv``.

Invariants: a layout that passed ``validate_layout`` has ``k.i``/``v.i`` buffers for every layer
with exactly ``block_size * num_kv_heads * head_dim * itemsize(dtype)`` bytes each, unique names,
and ``nbytes == sum of buffer sizes``. ``check_layout`` and ``check_header`` raise
``HeaderMismatch`` naming the first differing field; nothing that failed them is stored or loaded.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import msgspec

from kvmesh.engine.block_hash import HASH_LEN, BlockHash
from .errors import HeaderMismatch

HEADER_VERSION = 1
"""Bump when the meaning of a header field or the payload layout changes."""

DTYPE_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1}
"""Canonical dtype names (as ``block_hash.extra_key`` spells them) and their element sizes."""


class BufferSpec(msgspec.Struct, frozen=True, array_like=True):
    """One named buffer of a block: ``nbytes`` raw bytes."""

    name: str
    nbytes: int


KIND_KV = "kv"
KIND_STATE = "state"


class StateBufferSpec(msgspec.Struct, frozen=True, array_like=True):
    """One buffer of a recurrent-state checkpoint: ``name`` (``conv.i`` / ``ssm.i``, i = the
    model's layer index), element ``dtype`` and ``shape``; its bytes follow from them."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = DTYPE_SIZES.get(self.dtype, 0)
        for d in self.shape:
            n *= d
        return n


class BlockLayout(msgspec.Struct, frozen=True, kw_only=True):
    """What a block's bytes mean; equal layouts mean interchangeable blocks (given equal hashes)."""

    version: int = HEADER_VERSION
    extra_key: bytes
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    buffers: tuple[BufferSpec, ...]
    kind: str = KIND_KV
    state: tuple[StateBufferSpec, ...] = ()
    """``kind == "state"`` only: what each buffer is (``buffers`` repeats names and sizes)."""

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def offsets(self) -> Iterator[tuple[str, int, int]]:
        """(name, start, end) of each buffer inside a block's flat payload, in wire order."""
        pos = 0
        for b in self.buffers:
            yield b.name, pos, pos + b.nbytes
            pos += b.nbytes


class BlockHeader(msgspec.Struct, frozen=True):
    layout: BlockLayout
    block_hash: BlockHash
    parent_hash: BlockHash | None
    """None for the first block of a chain (its parent is ``ROOT_HASH``)."""


class BlockBatch(msgspec.Struct, frozen=True):
    """Headers of many blocks that share one layout, as they go on the wire (the layout once)."""

    layout: BlockLayout
    hashes: list[BlockHash]
    parents: list[BlockHash | None]

    def headers(self) -> list[BlockHeader]:
        return [BlockHeader(self.layout, h, p) for h, p in zip(self.hashes, self.parents, strict=True)]

    @classmethod
    def of(cls, headers: Sequence[BlockHeader]) -> BlockBatch:
        """Batch of ``headers``; they must share one layout (a batch is one model's blocks)."""
        if not headers:
            raise ValueError("a block batch needs at least one header")
        layout = headers[0].layout
        for h in headers[1:]:
            if h.layout != layout:
                check_layout(layout, h.layout)  # raises, naming the field that differs
        return cls(layout, [h.block_hash for h in headers], [h.parent_hash for h in headers])


def kv_buffer_names(num_layers: int) -> list[str]:
    return [f"{kind}.{i}" for i in range(num_layers) for kind in ("k", "v")]


def kv_layout(extra_key: bytes, dtype: str, block_size: int, num_layers: int, num_kv_heads: int,
              head_dim: int, extra_buffers: Sequence[BufferSpec] = ()) -> BlockLayout:
    """The layout of a plain attention model's block: K and V per layer, then ``extra_buffers``."""
    if dtype not in DTYPE_SIZES:
        raise ValueError(f"unknown KV dtype {dtype!r}; use one of {', '.join(DTYPE_SIZES)}")
    per = block_size * num_kv_heads * head_dim * DTYPE_SIZES[dtype]
    specs = tuple(BufferSpec(n, per) for n in kv_buffer_names(num_layers)) + tuple(extra_buffers)
    layout = BlockLayout(extra_key=extra_key, dtype=dtype, block_size=block_size, num_layers=num_layers,
                         num_kv_heads=num_kv_heads, head_dim=head_dim, buffers=specs)
    validate_layout(layout)
    return layout


def state_layout(kv: BlockLayout, specs: Sequence[StateBufferSpec]) -> BlockLayout:
    """The layout of the model's checkpoints, beside ``kv`` (its KV block layout): same identity
    and geometry, ``kind`` state, one buffer per spec in order."""
    layout = msgspec.structs.replace(kv, kind=KIND_STATE, state=tuple(specs),
                                     buffers=tuple(BufferSpec(s.name, s.nbytes) for s in specs))
    validate_layout(layout)
    return layout


def validate_layout(layout: BlockLayout) -> None:
    """Check a layout on its own (the receiver runs this on every incoming batch)."""
    if layout.version != HEADER_VERSION:
        raise HeaderMismatch("version", HEADER_VERSION, layout.version, "peer speaks another header version")
    if layout.dtype not in DTYPE_SIZES:
        raise HeaderMismatch("dtype", "|".join(DTYPE_SIZES), layout.dtype, "unknown dtype")
    for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
        if getattr(layout, name) < 1:
            raise HeaderMismatch(name, ">= 1", getattr(layout, name))
    if not layout.extra_key:
        raise HeaderMismatch("extra_key", "non-empty", layout.extra_key)
    names = [b.name for b in layout.buffers]
    if len(set(names)) != len(names) or any(b.nbytes < 0 for b in layout.buffers):
        raise HeaderMismatch("buffers", "unique names, sizes >= 0", names)
    if layout.kind == KIND_STATE:
        _validate_state(layout)
        return
    if layout.kind != KIND_KV or layout.state:
        raise HeaderMismatch("kind", f"{KIND_KV} (no state specs) or {KIND_STATE}", layout.kind)
    per = layout.block_size * layout.num_kv_heads * layout.head_dim * DTYPE_SIZES[layout.dtype]
    sizes = {b.name: b.nbytes for b in layout.buffers}
    for name in kv_buffer_names(layout.num_layers):
        if sizes.get(name) != per:
            raise HeaderMismatch("buffers", f"{name}: {per} bytes", f"{name}: {sizes.get(name)}",
                                 "buffer sizes disagree with the block geometry")


def _validate_state(layout: BlockLayout) -> None:
    if not layout.state:
        raise HeaderMismatch("state", "at least one buffer", "none")
    for spec in layout.state:
        if spec.dtype not in DTYPE_SIZES or not spec.shape or any(d < 1 for d in spec.shape):
            raise HeaderMismatch(f"state[{spec.name}]", "a known dtype and a shape of sizes >= 1",
                                 (spec.dtype, spec.shape))
    want = [(s.name, s.nbytes) for s in layout.state]
    have = [(b.name, b.nbytes) for b in layout.buffers]
    if want != have:
        raise HeaderMismatch("buffers", want, have, "buffers disagree with the state specs")


_LAYOUT_FIELDS = ("version", "kind", "extra_key", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim",
                  "state", "buffers")


def check_layout(expected: BlockLayout, got: BlockLayout) -> None:
    """Raise ``HeaderMismatch`` on the first field (in header order) where ``got`` differs."""
    if expected == got:
        return
    for name in _LAYOUT_FIELDS:
        want, have = getattr(expected, name), getattr(got, name)
        if want != have:
            if name == "buffers":
                want, have = [(b.name, b.nbytes) for b in want], [(b.name, b.nbytes) for b in have]
            if name == "state":  # name the first buffer whose dtype or shape differs
                for w, h in zip(want, have):
                    if w != h:
                        raise HeaderMismatch(f"state[{w.name}]", (w.name, w.dtype, w.shape), (h.name, h.dtype, h.shape))
                want, have = len(want), len(have)
            raise HeaderMismatch(name, want, have)


def check_hash(name: str, value: object, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, bytes) or len(value) != HASH_LEN:
        raise HeaderMismatch(name, f"{HASH_LEN}-byte hash", value)


def check_header(expected: BlockLayout, header: BlockHeader, block_hash: BlockHash | None = None,
                 parent_hash: BlockHash | None | bool = False) -> None:
    """Check ``header`` against the receiver's layout and, when given, the hash (and parent) it asked for.

    ``parent_hash=False`` skips the parent check; ``None`` or a hash requires that exact parent.
    """
    check_layout(expected, header.layout)
    check_hash("block_hash", header.block_hash)
    check_hash("parent_hash", header.parent_hash, allow_none=True)
    if block_hash is not None and header.block_hash != block_hash:
        raise HeaderMismatch("block_hash", block_hash, header.block_hash)
    if parent_hash is not False and header.parent_hash != parent_hash:
        raise HeaderMismatch("parent_hash", parent_hash, header.parent_hash)


def check_batch(batch: BlockBatch, expected: BlockLayout | None = None) -> None:
    """Validate an incoming batch: its layout (alone, or against ``expected``) and every hash."""
    if expected is not None:
        check_layout(expected, batch.layout)
    else:
        validate_layout(batch.layout)
    if len(batch.hashes) != len(batch.parents):
        raise HeaderMismatch("parent_hash", f"{len(batch.hashes)} parents", len(batch.parents))
    for h, p in zip(batch.hashes, batch.parents):
        check_hash("block_hash", h)
        check_hash("parent_hash", p, allow_none=True)
