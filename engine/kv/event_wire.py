"""KV events on the wire: the message layout engines publish and routers/cache nodes read.

The layout is the one vLLM's KV event publisher uses, so third-party routers that read vLLM
engines (Dynamo's ZMQ relay, llm-d's precise prefix-cache scorer) can read kvmesh engines too:

* PUB socket, one multipart message per event record::

      [topic, seq as 8-byte big-endian unsigned, msgpack(KVEventBatch)]

  ``KVEventBatch`` is the array ``[ts, [event, ...], data_parallel_rank]``; each event is a tagged
  array ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name]``, ``["BlockRemoved", block_hashes, medium]`` or ``["AllBlocksCleared"]``. Every
  field is sent, nil where kvmesh has no value (``data_parallel_rank``, ``lora_id``,
  ``lora_name``): llm-d's decoder refuses an array whose length is not its struct's. ``medium`` is the
  tier (``gpu``, ``cpu``, ``remote``), or for a hybrid model's recurrent-state checkpoints
  ``state-gpu`` (``state-cpu``, ``state-remote``): the same two records, one or more hashes, no
  parent, never token ids (even with ``--kv-events-token-ids``), so every vLLM-layout decoder
  reads them and one that keys on tokens (llm-d's) drops them. kvmesh sends one record per message, so the message
  ``seq`` is the record's ``KVEventLog`` sequence number and a gap in ``seq`` is a lost record.
  The topic is ``kv-events/<engine id>``: a subscriber that subscribes to the prefix
  ``kv-events`` receives every engine's stream and can still tell them apart.

* The ``llm-d`` format (``--kv-events-format llm-d``) is the same stream under the topic
  ``kv@<pod>@<model>``, which llm-d's precise prefix-cache indexer (github.com/llm-d/llm-d-kv-cache,
  pkg/kvevents) splits on ``@`` to learn the pod and the model. That indexer keys blocks by hashes
  of their token ids, so it needs them in ``BlockStored`` (``--kv-events-token-ids``) and its
  block size must equal the engine's. It reads a 32-byte block hash as the integer of its last 8
  bytes (big-endian), and a ``BlockStored`` whose parent it has not seen is dropped, which is why
  the first block of a chain carries no parent (nil). kvmesh's own subscribers read either topic:
  one that names no engine is attributed to the engine the snapshot names.

* Replay (ROUTER socket, the PUB port + 1): a DEALER sends one frame, the first wanted seq as
  8-byte big-endian. The engine answers ``[b"", seq, payload]`` for every buffered record from
  that seq on, then the end marker ``[b"", REPLAY_END, b""]``. When the wanted seq is older
  than the buffer it answers from the oldest record it holds (as vLLM's publisher does); the
  subscriber sees the skip and resyncs from the HTTP snapshot (``GET /kv/snapshot``, ``snapshot_to_json``).

Invariant: ``to_internal(from_internal(e)) == e`` for every internal event (the tests check it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from kvmesh.engine.block_hash import BlockHash
from .events import (
    MEDIA,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventRecord,
    KVSnapshot,
    is_state_medium,
)

TOPIC_PREFIX = b"kv-events"
REPLAY_END = (-1).to_bytes(8, "big", signed=True)
"""The seq frame that ends a replay answer (its payload frame is empty)."""
SNAPSHOT_FORMAT = "kvmesh-kv-snapshot-v1"


KVMESH_FORMAT = "kvmesh"
LLMD_FORMAT = "llm-d"
EVENT_FORMATS = (KVMESH_FORMAT, LLMD_FORMAT)
LLMD_TOPIC_PREFIX = "kv@"


class TopicError(ValueError):
    """A topic cannot be formed from the given names (the text says which and why)."""


def topic_for(engine_id: str) -> bytes:
    return TOPIC_PREFIX + b"/" + engine_id.encode()


def llmd_topic(pod: str, model: str) -> bytes:
    """``kv@<pod>@<model>``; llm-d splits it on ``@`` into exactly three parts, so neither name may
    hold one (nor be empty)."""
    for what, name in (("pod", pod), ("model", model)):
        if not name or "@" in name:
            raise TopicError(f"llm-d KV event topics are kv@<pod>@<model>; the {what} name {name!r} "
                             f"{'is empty' if not name else 'contains @'}: choose another "
                             f"{'--kv-events-pod' if what == 'pod' else '--served-model-name'}")
    return f"{LLMD_TOPIC_PREFIX}{pod}@{model}".encode()


@dataclass(frozen=True)
class TopicScheme:
    """Which topic a publisher sends under: ``kvmesh`` (``kv-events/<engine id>``) or ``llm-d``
    (``kv@<pod>@<model>``; ``pod`` empty means the engine id)."""

    format: str = KVMESH_FORMAT
    pod: str = ""

    def __post_init__(self) -> None:
        if self.format not in EVENT_FORMATS:
            raise TopicError(f"unknown KV event format {self.format!r}; use one of {', '.join(EVENT_FORMATS)}")
        if self.pod and "@" in self.pod:
            llmd_topic(self.pod, "x")  # raises with the message

    def topic(self, engine_id: str, model: str) -> bytes:
        if self.format == LLMD_FORMAT:
            return llmd_topic(self.pod or engine_id, model)
        return topic_for(engine_id)


def engine_of_topic(topic: bytes) -> str:
    """The engine id a topic names (empty when the publisher used the bare prefix)."""
    return topic[len(TOPIC_PREFIX) + 1:].decode() if topic.startswith(TOPIC_PREFIX + b"/") else ""


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def seq_from_bytes(raw: bytes) -> int:
    """Sequence number of a seq frame; -1 for ``REPLAY_END``."""
    if len(raw) != 8:
        raise WireFormatError(f"a seq frame has 8 bytes, got {len(raw)}")
    return int.from_bytes(raw, "big", signed=raw == REPLAY_END)


class WireFormatError(ValueError):
    """A message does not follow the KV event layout (the text says which part)."""


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    """Every field is sent, ``data_parallel_rank`` too (nil: kvmesh has none): strict decoders
    (llm-d's Go msgpack) refuse an array whose length differs from their struct's."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class WireEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged event records (the tag is the class name on the wire)."""


class WireBlockStored(WireEvent, tag="BlockStored"):
    """All of vLLM's fields, ``lora_name`` included (nil), for the same strict decoders."""

    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class WireBlockRemoved(WireEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None


class WireAllBlocksCleared(WireEvent, tag="AllBlocksCleared"):
    medium: str | None = None
    """Not in vLLM's record: absent or nil means gpu. A clear of another tier carries it; decoders
    of vLLM's record that tolerate a trailing element (msgspec's array-like structs) read it as a
    clear, strict ones (llm-d's) skip it, as llm-d does with every clear anyway."""


class WireGpuBlocksCleared(WireEvent, tag="AllBlocksCleared"):
    """A gpu clear exactly as vLLM sends it: no fields. Encoding only (``WireAllBlocksCleared``
    decodes it)."""


class KVEventBatch(EventBatch):
    events: list[WireBlockStored | WireBlockRemoved | WireAllBlocksCleared]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def from_internal(event: KVEvent, token_ids: bool = True) -> WireEvent:
    """``token_ids=False`` sends ``BlockStored`` with an empty token list (the prompt stays private;
    hash-based indexers need none of it). A checkpoint record never carries tokens: a consumer
    that keys on them would index the checkpoint as a KV block."""
    if isinstance(event, BlockStored):
        send = token_ids and not is_state_medium(event.tier)
        return WireBlockStored(list(event.block_hashes), event.parent_hash,
                               list(event.token_ids) if send else [], event.block_size, None, event.tier)
    if isinstance(event, BlockRemoved):
        return WireBlockRemoved(list(event.block_hashes), event.tier)
    if isinstance(event, AllBlocksCleared):
        return WireGpuBlocksCleared() if event.tier == "gpu" else WireAllBlocksCleared(event.tier)
    raise TypeError(f"not a KV event: {event!r}")


def _hash(h: bytes | int) -> BlockHash:
    if isinstance(h, int):  # vLLM engines may send 64-bit ints; kvmesh always sends 32 bytes
        return h.to_bytes(32, "big", signed=h < 0)
    return bytes(h)


def _tier(medium: str | None) -> str:
    tier = (medium or "gpu").lower()
    if tier not in MEDIA:
        raise WireFormatError(f"unknown medium {medium!r}; expected one of {', '.join(MEDIA)}")
    return tier


def to_internal(event: WireEvent) -> KVEvent:
    if isinstance(event, WireBlockStored):
        parent = None if event.parent_block_hash is None else _hash(event.parent_block_hash)
        return BlockStored([_hash(h) for h in event.block_hashes], parent, list(event.token_ids),
                           event.block_size, _tier(event.medium))
    if isinstance(event, WireBlockRemoved):
        return BlockRemoved([_hash(h) for h in event.block_hashes], _tier(event.medium))
    if isinstance(event, WireAllBlocksCleared):
        return AllBlocksCleared(_tier(event.medium))
    if isinstance(event, WireGpuBlocksCleared):
        return AllBlocksCleared()
    raise TypeError(f"not a wire KV event: {event!r}")


def encode_record(rec: KVEventRecord, token_ids: bool = True) -> tuple[bytes, bytes]:
    """(seq frame, payload frame) of one record (``token_ids``: see ``from_internal``)."""
    return seq_bytes(rec.seq), _encoder.encode(KVEventBatch(rec.timestamp, [from_internal(rec.event, token_ids)]))


def decode_payload(payload: bytes) -> KVEventBatch:
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError as e:
        raise WireFormatError(f"not a KV event batch: {e}") from None


def snapshot_to_json(snap: KVSnapshot) -> dict[str, Any]:
    """JSON body of ``GET /kv/snapshot``: every tier's hashes (hex) valid at ``seq``."""
    return {"format": SNAPSHOT_FORMAT, "engine_id": snap.engine_id, "seq": snap.seq,
            "tiers": {t: sorted(h.hex() for h in hs) for t, hs in snap.hashes.items()}}


def snapshot_from_json(doc: dict[str, Any]) -> KVSnapshot:
    if doc.get("format") != SNAPSHOT_FORMAT:
        raise WireFormatError(f"snapshot format {doc.get('format')!r}; expected {SNAPSHOT_FORMAT!r}")
    try:
        tiers = {_tier(t): frozenset(bytes.fromhex(h) for h in hs) for t, hs in doc["tiers"].items()}
        return KVSnapshot(int(doc["seq"]), str(doc["engine_id"]), tiers)
    except (KeyError, TypeError, ValueError) as e:
        raise WireFormatError(f"malformed snapshot: {e}") from None
