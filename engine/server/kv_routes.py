"""``GET /kv/snapshot``, ``/kv/info`` and ``/kv/tokenizer``: what a router needs to follow an
engine's KV cache.

``/kv/snapshot`` is the resync point of the KV event stream (``event_wire.snapshot_to_json``);
``/kv/info`` tells a router how to compute the engine's block hash chain (including its
tokenizer's fingerprint) and where the event stream is published; ``/kv/tokenizer`` ships the
tokenizer itself (``Tokenizer.to_payload``), so a router that cannot read the model (a Volume
or URI model it does not mount) tokenizes prompts exactly as the engines do. All answer 503
(OpenAI error format) until the engine has loaded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from kvmesh.engine.block_hash import HASH_FUNCTION, ROOT_HASH
from kvmesh.engine.kv.event_publisher import KVEventPublisher
from kvmesh.engine.kv.event_wire import snapshot_to_json, topic_for
from kvmesh.engine.kv.events import STATE_MEDIA, TIER_GPU
from kvmesh.engine.api import errors
from kvmesh.engine.server.async_engine import AsyncEngine, ServerState


def kv_events_info(publisher: KVEventPublisher | None, engine_id: str) -> dict[str, Any] | None:
    if publisher is None:
        return None
    topic = publisher.topic or topic_for(engine_id)  # None only before the engine loaded
    return {"port": publisher.port, "replay_port": publisher.replay_port, "topic": topic.decode(),
            "format": publisher.scheme.format}


def kv_info(engine: Any, publisher: KVEventPublisher | None) -> dict[str, Any]:
    """Body of ``/kv/info`` for a loaded engine.

    ``extra_key`` is the exact byte string the engine hashes (hex); ``model``, ``dtype``,
    ``lora`` and ``cache_salt`` are its readable parts, so a router can either use the bytes
    as they are or rebuild them with ``block_hash.extra_key(model, dtype, lora, cache_salt)``.
    ``hybrid`` says a prefix hit also needs a recurrent-state checkpoint at its end (a router
    counts such an engine's hit only up to its last checkpointed block).
    """
    return {
        "engine_id": engine.engine_id,
        "block_size": engine.config.block_size,
        "max_model_len": engine.max_model_len,
        "hash_function": HASH_FUNCTION,
        "root_hash": ROOT_HASH.hex(),
        "extra_key": engine.kv.extra.hex(),
        "model": engine.model_id,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "lora": None,
        "cache_salt": engine.config.cache_salt or None,
        "tokenizer": engine.tokenizer.fingerprint,
        "kv_events": kv_events_info(publisher, engine.engine_id),
        "tiers": [engine.kv.pool.tier],
        "hybrid": bool(getattr(engine, "is_hybrid", False)),
        "state_checkpoints": state_checkpoints_info(engine),
    }


def state_checkpoints_info(engine: Any) -> dict[str, Any] | None:
    """A hybrid engine's checkpoint pool as ``/kv/info`` reports it (None: not hybrid, or no pool,
    so it gets no prefix hits at all). Its checkpoints appear in the KV events under ``medium``."""
    states = getattr(engine, "state_slots", None)
    stats = states.stats() if states is not None else None
    if stats is None:
        return None
    return {"medium": STATE_MEDIA[TIER_GPU], "capacity": stats.capacity, "entry_bytes": stats.entry_bytes,
            "interval_tokens": states.interval}


def add_kv_routes(app: FastAPI, aengine: AsyncEngine, publisher: KVEventPublisher | None,
                  role_info: Callable[[], dict[str, Any]] | None = None) -> None:
    """``role_info`` adds the server's ``role``, ``transfer_port`` (docs/disagg.md) and
    ``served_model_names`` (the names its OpenAI routes answer to) to ``/kv/info``."""
    def loaded_engine() -> Any:
        if aengine.engine is None:
            if aengine.state is ServerState.FAILED:
                raise errors.engine_failed(str(aengine.failure))
            raise errors.not_ready()
        return aengine.engine

    @app.get("/kv/snapshot")
    async def kv_snapshot() -> dict[str, Any]:
        return snapshot_to_json(loaded_engine().events.snapshot())

    tokenizer_body: dict[str, Any] | None = None  # built once: a few MB of JSON, fixed for the process's life

    @app.get("/kv/tokenizer")
    async def kv_tokenizer() -> dict[str, Any]:
        nonlocal tokenizer_body
        if tokenizer_body is None:
            tokenizer_body = await asyncio.to_thread(loaded_engine().tokenizer.to_payload)
        return tokenizer_body

    @app.get("/kv/info")
    async def kv_info_route() -> dict[str, Any]:
        info = kv_info(loaded_engine(), publisher)
        info.update(role_info() if role_info is not None else {"role": "both", "transfer_port": None})
        return info
