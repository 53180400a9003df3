"""Fake prefill and decode engines that follow the router/engine HTTP contract of docs/disagg.md.

They stand in for the engines only as far as the router can tell: no KV is computed or moved.
A ``FakeDecode`` keeps a set of completed transfer ids; a ``FakePrefill`` answering stage 1
finds the decode engine by its transfer port in ``DECODERS`` (in process, standing in for the
UCX connection between the engines) and either records the transfer id there or answers what a
prefill engine answers when the decode side fails (decode_no_room, decode_unreachable,
decode_failed). Their ``handle`` asserts the contract's request shapes, so a router that sends
the wrong ``kv_transfer_params`` gets a 400 back.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any

from .fake_http_engine import FakeEngine, json_response

DECODERS: dict[int, FakeDecode] = {}
"""Transfer port -> the fake decode engine listening on it."""
_ports = itertools.count(42000)


def error(code: str, message: str = "scripted") -> dict[str, Any]:
    return {"error": {"message": message, "type": "x", "param": None, "code": code}}


@dataclass
class FakeDecode(FakeEngine):
    """A decode engine: ``room``, ``reachable``, ``fail_transfer``, ``refuse_transfer`` script what
    stage 1 meets;
    ``forget_transfers`` makes stage 2 answer 409 transfer_not_found."""

    transfer_port: int = 0
    room: bool = True
    reachable: bool = True
    fail_transfer: bool = False
    refuse_transfer: bool = False
    forget_transfers: bool = False
    free_blocks: int = 1000
    transfers: set[str] = field(default_factory=set)
    served: list[str] = field(default_factory=list)  # transfer ids answered in stage 2

    def __post_init__(self) -> None:
        self.transfer_port = self.transfer_port or next(_ports)
        DECODERS[self.transfer_port] = self

    def metrics_text(self) -> str:
        return super().metrics_text() + \
            f'kvmesh_kv_cache_free_blocks{{model_name="fake-model",tier="gpu"}} {float(self.free_blocks)}\n'

    def kv_info(self) -> dict[str, Any]:
        return {**super().kv_info(), "role": "decode", "transfer_port": self.transfer_port}

    async def handle(self, req: dict[str, Any], receive: Any, send: Any) -> None:
        params = req.get("kv_transfer_params")
        if params is None:  # a plain request: a decode engine serves it itself
            return await super().handle(req, receive, send)
        if set(params) != {"transfer_id"}:
            return await json_response(send, 400, error("bad_kv_transfer_params", f"stage 2 got {params}"))
        tid = params["transfer_id"]
        if self.forget_transfers or tid not in self.transfers:
            return await json_response(send, 409, error("transfer_not_found"))
        self.transfers.discard(tid)
        self.served.append(tid)
        await super().handle(req, receive, send)


@dataclass
class FakePrefill(FakeEngine):
    """A prefill engine: stage 1 answers with a kv_transfer object, or relays the decode side's
    failure; ``behavior`` (status, die_before_first) scripts the prefill engine's own failures;
    ``stage1_delay_s`` stands for the prefill compute and the KV transfer."""

    stage1_delay_s: float = 0.0

    def kv_info(self) -> dict[str, Any]:
        return {**super().kv_info(), "role": "prefill", "transfer_port": None}

    async def handle(self, req: dict[str, Any], receive: Any, send: Any) -> None:
        if self.behavior.mode in ("status", "die_before_first"):
            return await super().handle(req, receive, send)
        if req.get("n", 1) > 1:
            return await json_response(send, 400, error("n_not_supported"))
        params = req.get("kv_transfer_params") or {}
        if set(params) != {"transfer_id", "decode_host", "decode_port"}:
            return await json_response(send, 400, error("bad_kv_transfer_params", f"stage 1 got {params}"))
        dec = DECODERS.get(params["decode_port"])
        if dec is None or not dec.reachable or params["decode_host"] != "127.0.0.1":
            return await json_response(send, 502, error("decode_unreachable"))
        if not dec.room:
            return await json_response(send, 503, error("decode_no_room"))
        if dec.fail_transfer:
            return await json_response(send, 502, error("decode_failed"))
        if dec.refuse_transfer:
            return await json_response(send, 502, error("decode_refused"))
        await asyncio.sleep(self.stage1_delay_s)
        dec.transfers.add(params["transfer_id"])
        await json_response(send, 200, {"object": "kv_transfer", "transfer_id": params["transfer_id"],
                                        "prompt_tokens": 10, "cached_tokens": 0, "decode_hit_blocks": 1,
                                        "blocks_sent": 2, "bytes_sent": 2048, "prefill_s": 0.001,
                                        "transfer_s": 0.001})
