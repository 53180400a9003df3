"""llm-d's KV event consumer, written from its published Go code, to read kvmesh's stream with.

Ported from github.com/llm-d/llm-d-kv-cache v0.5.0 (served by the Go module proxy as
github.com/llm-d/llm-d-kv-cache-manager@v0.5.0): pkg/kvevents/zmq_subscriber.go (frames and
topic), pkg/kvevents/events.go + pool.go (msgpack layout, how events change the index) and
pkg/kvcache/kvblock/in_memory.go + token_processor.go (the index and its request keys). It
shares nothing with kvmesh's own wire code (kvmesh/engine/kv/event_wire.py): msgpack is parsed
generically (msgspec without a schema) and every field is checked the way the Go decoder
would take it, so a layout kvmesh got wrong fails here instead of being read back by the same
code that wrote it.

Request keys follow llm-d's chunked token database: FNV-64a over the canonical CBOR encoding of
``[parent, tokens, extra]``, chained from ``hash(fnv64a(seed), nil, model)``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import msgspec

TOPIC_FILTER = b"kv@"  # llm-d's default subscription
DEFAULT_TIER = "gpu"  # "GPU" lowered, what pool.go uses when an event names no medium
_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_MASK = (1 << 64) - 1


class LlmdDecodeError(ValueError):
    """What llm-d's subscriber or pool would drop (with the reason its Go code logs)."""


@dataclass(frozen=True)
class Message:
    topic: str
    seq: int
    payload: bytes
    pod: str
    model: str


def parse_frames(frames: list[bytes]) -> Message:
    """zmq_subscriber.go: three frames; the topic split on ``@`` into exactly three parts."""
    if len(frames) != 3:
        raise LlmdDecodeError(f"expected 3 frames, got {len(frames)}")
    topic = frames[0].decode()
    parts = topic.split("@")
    if len(parts) != 3:
        raise LlmdDecodeError(f"topic {topic!r} is not kv@<pod-id>@<model-name>")
    if len(frames[1]) != 8:
        raise LlmdDecodeError(f"seq frame has {len(frames[1])} bytes")
    return Message(topic, struct.unpack(">Q", frames[1])[0], frames[2], parts[1], parts[2])


# ---- llm-d's request keys (kvblock/token_processor.go) ----------------------------------------------

def _fnv64a(data: bytes) -> int:
    h = _FNV_OFFSET
    for b in data:
        h = ((h ^ b) * _FNV_PRIME) & _MASK
    return h


def _cbor_head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for extra, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if n < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | extra]) + struct.pack(fmt, n)
    raise ValueError(f"{n} does not fit 64 bits")


def cbor(value: Any) -> bytes:
    """Canonical CBOR of the values llm-d hashes: unsigned ints, lists of them, strings, None."""
    if value is None:
        return b"\xf6"
    if isinstance(value, int) and value >= 0:
        return _cbor_head(0, value)
    if isinstance(value, str):
        raw = value.encode()
        return _cbor_head(3, len(raw)) + raw
    if isinstance(value, list):
        return _cbor_head(4, len(value)) + b"".join(cbor(v) for v in value)
    raise TypeError(f"cannot encode {value!r}")


def block_hash(parent: int, tokens: list[int] | None, extra: Any) -> int:
    return _fnv64a(cbor([parent, tokens, extra]))


def request_keys(parent: int | None, tokens: list[int], model: str, block_size: int, seed: str = "") -> list[int]:
    """TokensToKVBlockKeys: full chunks only, each key chained on the one before."""
    prefix = parent if parent is not None else block_hash(_fnv64a(seed.encode()), None, model)
    keys = []
    for i in range(0, len(tokens) - block_size + 1, block_size):
        prefix = block_hash(prefix, list(tokens[i:i + block_size]), None)
        keys.append(prefix)
    return keys


# ---- events.go + pool.go ------------------------------------------------------------------------------

def _hash_u64(raw: Any) -> int:
    """pool.go getHashAsUint64: ints as they are, bytes as the big-endian integer of the last 8."""
    if isinstance(raw, bool) or not isinstance(raw, (int, bytes)):
        raise LlmdDecodeError(f"unsupported hash type: {type(raw).__name__}")
    if isinstance(raw, int):
        return raw & _MASK
    if not raw:
        raise LlmdDecodeError("hash byte slice is empty")
    return int.from_bytes(raw[-8:], "big")


def _uint32s(raw: Any) -> list[int]:
    if not isinstance(raw, list) or not all(isinstance(t, int) and 0 <= t < 1 << 32 for t in raw):
        raise LlmdDecodeError(f"TokenIds is not a list of uint32: {raw!r:.80}")
    return raw


# Fields after the tag. llm-d's msgpack library (vmihailenco/msgpack v5) decodes an array into a
# struct only when the lengths are equal ("number of fields in array-encoded struct has changed").
FIELDS = {"BlockStored": 7, "BlockRemoved": 2, "AllBlocksCleared": 0}


def decode_events(payload: bytes) -> list[list[Any]]:
    """EventBatch ``[ts, [event, ...], data_parallel_rank]`` (exactly three elements); each event
    a tagged array. A batch that does not decode is dropped whole."""
    batch = msgspec.msgpack.decode(payload)
    if not isinstance(batch, list) or len(batch) != 3 or not isinstance(batch[0], float) \
            or not isinstance(batch[1], list) or not (batch[2] is None or isinstance(batch[2], int)):
        raise LlmdDecodeError(f"not an EventBatch [ts, events, data_parallel_rank]: {batch!r:.80}")
    return batch[1]


@dataclass
class LlmdIndex:
    """The in-memory index llm-d's pool fills: engine key -> request key, request key -> (pod, tier)."""

    block_size: int
    engine_to_request: dict[int, int] = field(default_factory=dict)
    pods: dict[int, set[tuple[str, str]]] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)
    """Events (or parts) llm-d would log and skip, with the reason."""

    def digest(self, msg: Message) -> None:
        for ev in decode_events(msg.payload):
            try:
                self._apply(msg, ev)
            except LlmdDecodeError as e:
                tag = ev[0] if isinstance(ev, list) and ev else repr(ev)
                self.dropped.append(f"{tag}: {e}")

    def _apply(self, msg: Message, ev: Any) -> None:
        if not isinstance(ev, list) or not ev or ev[0] not in FIELDS:
            raise LlmdDecodeError(f"unknown event tag in {ev!r:.80}")
        tag, fields = ev[0], ev[1:]
        if len(fields) != FIELDS[tag]:
            raise LlmdDecodeError("number of fields in array-encoded struct has changed")
        if tag == "AllBlocksCleared":
            return  # pool.go ignores it
        if tag == "BlockRemoved":
            hashes, medium = fields
            entry = (msg.pod, (medium or DEFAULT_TIER).lower())
            for raw in hashes:
                key = self.engine_to_request.get(_hash_u64(raw))
                if key is None:
                    continue
                held = self.pods.get(key, set())
                held.discard(entry)
                if not held:
                    self.pods.pop(key, None)
                    self.engine_to_request.pop(_hash_u64(raw), None)
            return
        hashes, parent, tokens, size, _lora_id, medium, lora_name = fields
        if not isinstance(size, int):
            raise LlmdDecodeError(f"BlockSize {size!r}")
        engine_keys = [_hash_u64(h) for h in hashes]
        parent_key = None
        if parent is not None:
            parent_key = self.engine_to_request.get(_hash_u64(parent))
            if parent_key is None:
                raise LlmdDecodeError("parent block unknown (no request key)")
        model = lora_name or msg.model
        keys = request_keys(parent_key, _uint32s(tokens), model, self.block_size)
        if not engine_keys or not keys:
            raise LlmdDecodeError("no keys or entries provided for adding to index")
        if len(engine_keys) != len(keys):
            raise LlmdDecodeError("mismatch between engine keys and request keys length")
        tier = (medium or DEFAULT_TIER).lower()
        for ek, rk in zip(engine_keys, keys):
            self.engine_to_request[ek] = rk
            self.pods.setdefault(rk, set()).add((msg.pod, tier))

    def longest_prefix(self, tokens: list[int], model: str, pod: str) -> int:
        """Leading full blocks of ``tokens`` the index places on ``pod`` (what the precise
        prefix-cache scorer counts for it)."""
        n = 0
        for key in request_keys(None, tokens, model, self.block_size):
            if pod not in {p for p, _ in self.pods.get(key, ())}:
                break
            n += 1
        return n
