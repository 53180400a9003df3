"""The HTTP side of prefill/decode roles: stage 1 on a prefill engine, stage 2 on a decode engine.

docs/disagg.md is the contract with the router. A request carrying ``kv_transfer_params`` with a
``decode_host`` is a stage-1 request (prefill role): reserve on the decode engine, compute the
prompt and the first token, push the KV, answer a ``kv_transfer`` JSON object. One carrying only a
``transfer_id`` is a stage-2 request (decode role): take over the transferred KV and answer
exactly like a colocated engine.

Invariants: a stage-1 request frees everything it took on every path: the decode reservation is
cancelled when nothing was pushed, the held blocks are released once the push ended (confirmed
or failed); a stage-2 request that finds no completed transfer is answered 409 before any byte
of a response is sent, so the router can start over.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvmesh.engine.api import errors
from kvmesh.engine.block_hash import chain_root
from kvmesh.engine.server.async_engine import AsyncEngine
from kvmesh.engine.api.errors import APIError
from kvmesh.engine.server.generation import Prepared, Serving, engine_error
from kvmesh.engine.api.protocol import KVTransferParams
from kvmesh.engine.roles import ROLES, DecodeClaim, PrefillHandoff
from kvmesh.engine.server.streaming import EventStreamResponse, watch_disconnect

log = logging.getLogger("kvmesh.server.disagg")

def _err(message: str, status: int, code: str, headers: dict[str, str] | None = None) -> APIError:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return APIError(message, status, kind, code, "kv_transfer_params", headers)


class DisaggServing:
    """Role-specific request handling and the transfer endpoints it owns (started once loaded)."""

    def __init__(self, role: str, aengine: AsyncEngine, serving: Serving, *, transfer_port: int = 0,
                 transfer_host: str = "0.0.0.0", transfer_timeout_s: float = 30.0, overlap: bool = True,
                 tail_tokens: int = 0,
                 observe: Callable[[str, int, float | None], None] = lambda outcome, nbytes, seconds: None,
                 token: Callable[[], str | None] = lambda: None) -> None:
        """``observe(outcome, bytes, seconds)`` counts each stage-1 handoff (the server's metrics);
        ``overlap`` pushes prompt blocks while later chunks are still being computed, the last chunk
        cut to ``tail_tokens`` (roles.PrefillHandoff); ``token``
        gives the internal token both ends of a KV connection prove (transfer/auth.py)."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; use one of {', '.join(ROLES)}")
        self.role = role
        self.aengine = aengine
        self.serving = serving
        self.transfer_port = transfer_port
        self.transfer_host = transfer_host
        self.transfer_timeout_s = transfer_timeout_s
        self.overlap = overlap
        self.tail_tokens = tail_tokens if overlap else 0
        self.endpoint: Any = None  # decode: DecodeEndpoint
        self.links: Any = None  # prefill: DecodeLinks
        self._observe = observe
        self.token = token

    @property
    def auth_failures(self) -> int:
        """Decode role: transfer connections closed for not proving the internal token."""
        return self.endpoint.server.auth_failures if self.endpoint is not None else 0

    @property
    def header_mismatches(self) -> int:
        """Decode role: reservations refused for a KV or recurrent-state layout other than this engine's."""
        return self.endpoint.handler.header_mismatches if self.endpoint is not None else 0

    # ---- lifecycle ------------------------------------------------------------------------------
    def on_loaded(self) -> None:
        engine = self.aengine.engine
        if self.role == "decode":
            from kvmesh.engine.disagg.decode_link import DecodeEndpoint

            self.endpoint = DecodeEndpoint(engine, self.transfer_port, accepting=lambda: self.aengine.ready,
                                           token=self.token, host=self.transfer_host)
        elif self.role == "prefill":
            from kvmesh.engine.kv.gather import cache_layout
            from kvmesh.engine.kv.slot_wire import slot_state_layout
            from kvmesh.engine.disagg.prefill_link import DecodeLinks

            layout = cache_layout(engine.kv.extra, engine.runner.kv_cache)
            states = engine.runner.states  # a hybrid model's: its state goes with the KV
            state = None if states is None else slot_state_layout(layout, states, engine.model_config.linear_layers)
            # A connection attempt gets part of the transfer budget, so a dead peer is reported as
            # unreachable (not as a timeout) within it.
            self.links = DecodeLinks(layout, self.transfer_timeout_s, connect_timeout_s=min(5.0, self.transfer_timeout_s / 2),
                                     token=self.token, state_layout=state)

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
        if self.links is not None:
            self.links.close()
            self.links = None

    def info(self) -> dict[str, Any]:
        """``role`` and ``transfer_port`` for ``/kv/info``."""
        return {"role": self.role, "transfer_port": self.endpoint.port if self.endpoint is not None else None}

    # ---- requests -------------------------------------------------------------------------------
    async def respond(self, prep: Prepared, kvp: KVTransferParams, request: Request,
                      arrival: float) -> Response | EventStreamResponse:
        if any(c.params.prompt_logprobs is not None for c in prep.choices):
            raise _err("prompt logprobs are not served with prefill/decode disaggregation: the prompt is "
                       "scored on the prefill engine; send the request to a colocated pool", 400, "invalid_request")
        if len(prep.choices) != 1:
            raise _err("a KV transfer carries one sequence; send n > 1 (or several prompts) to a decode or "
                       "colocated engine directly", 400, "n_not_supported")
        if kvp.decode_host is not None or kvp.decode_port is not None:
            if self.role != "prefill" or self.links is None:
                raise _err(f"this engine runs --role {self.role}; stage 1 of a KV transfer goes to a prefill "
                           "engine", 400, "wrong_role")
            if kvp.decode_host is None or kvp.decode_port is None:
                raise _err("kv_transfer_params needs both decode_host and decode_port", 400, "invalid_request")
            return await self._prefill(prep, kvp, request, arrival)
        if self.role != "decode":
            raise _err(f"this engine runs --role {self.role}; stage 2 of a KV transfer goes to a decode engine",
                       400, "wrong_role")
        return await self._decode(prep, kvp, request, arrival)

    def _push_failed(self, host: str, port: int, e: BaseException) -> APIError:
        """A push that failed: ``decode_refused`` when the decode engine answered (it is up and
        serving: e.g. the reservation expired), ``decode_failed`` when the link itself failed."""
        from kvmesh.engine.transfer.errors import RemoteError

        code = "decode_refused" if isinstance(e, RemoteError) else "decode_failed"
        self._failed(code)
        return _err(f"KV transfer to decode engine {host}:{port} failed: {e}", 502, code)

    def _failed(self, code: str) -> None:
        self._observe(code, 0, None)

    async def _prefill(self, prep: Prepared, kvp: KVTransferParams, request: Request, arrival: float) -> JSONResponse:
        from kvmesh.engine.disagg.prefill_link import Refused
        from kvmesh.engine.disagg.prefill_side import DECODE
        from kvmesh.engine.transfer import protocol
        from kvmesh.engine.transfer.errors import ConnectFailed, TransferError

        assert kvp.decode_host is not None and kvp.decode_port is not None
        host, port, tid = kvp.decode_host, kvp.decode_port, kvp.transfer_id
        prompt, params = prep.prompts[0], prep.choices[0].params
        engine = self.aengine.engine
        self.aengine.check_accepting(1)
        try:
            engine.check_request(prompt, params)  # refuse what this engine cannot run before reserving
        except Exception as e:  # noqa: BLE001 - validation errors become 4xx
            raise engine_error(e, "prompt" if prep.kind == "completion" else "messages") from None
        t0 = time.perf_counter()
        try:
            res = await self.links.reserve(host, port, tid, prompt, params.max_tokens, chain_root(prep.cache_salt))
        except Refused as e:
            if e.kind == protocol.ERR_NO_ROOM:
                self._failed("decode_no_room")
                raise _err(f"decode engine {host}:{port} has no room: {e}", 503, "decode_no_room",
                           {"Retry-After": "1"}) from None
            self._failed("decode_too_large" if e.kind == protocol.ERR_TOO_LARGE else "decode_failed")
            if e.kind == protocol.ERR_TOO_LARGE:
                raise _err(str(e), 400, "decode_too_large") from None
            raise _err(f"decode engine {host}:{port} refused the transfer ({e.kind}): {e}", 502,
                       "decode_failed") from None
        except ConnectFailed as e:
            self._failed("decode_unreachable")
            raise _err(str(e), 502, "decode_unreachable") from None
        except TransferError as e:
            self._failed("decode_failed")
            raise _err(f"reservation on decode engine {host}:{port} failed: {e}", 502, "decode_failed") from None
        t1 = time.perf_counter()
        try:
            group = self.serving.submit(prep, arrival, PrefillHandoff(res.hit_blocks, stream=self.overlap,
                                                                      tail_tokens=self.tail_tokens))
        except BaseException:
            await self.links.cancel(host, port, tid)
            raise
        handoff = None
        parts: list[asyncio.Task] = []  # partial pushes, each awaiting the one before it

        async def push_after(prev: asyncio.Task | None, part: Any, final: bool) -> Any:
            if prev is not None:
                await prev  # a failed earlier part fails this one: parts land in order or not at all
            return await self.links.push(host, port, tid, part, final)

        def stop_on_failure(task: asyncio.Task) -> None:
            if not task.cancelled() and task.exception() is not None:
                self.aengine.abort(group)  # no point computing the rest of a prompt nobody receives

        watcher = watch_disconnect(request.receive, lambda: self.aengine.abort(group))
        try:
            while handoff is None:
                outs = await group.next_outputs()
                if not outs:
                    break
                for out in outs:
                    if out.finished and out.finish_reason == "transfer":
                        handoff = out.handoff
                    elif out.handoff is not None:
                        parts.append(asyncio.ensure_future(push_after(parts[-1] if parts else None,
                                                                      out.handoff, False)))
                        parts[-1].add_done_callback(stop_on_failure)
                    elif out.finish_reason == "error":
                        raise errors.engine_failed(out.error or "the prefill failed")
        finally:
            watcher.cancel()
            self.aengine.release(group)
            if handoff is None:
                for t in parts:
                    t.cancel()
                await self.links.cancel(host, port, tid)
        if handoff is None:
            failed = next((t.exception() for t in parts if t.done() and not t.cancelled() and t.exception()), None)
            if failed is not None:
                raise self._push_failed(host, port, failed)
            raise _err("the request was aborted before its prefill finished", 499, "aborted")
        t2 = time.perf_counter()
        try:
            final = await push_after(parts[-1] if parts else None, handoff, True)
            pushed = [p.result() for p in parts] + [final]
        except TransferError as e:
            raise self._push_failed(host, port, e) from None
        finally:
            engine.prefill.release(handoff.request_id, DECODE)
        t3 = time.perf_counter()
        nbytes = sum(p.nbytes for p in pushed)
        self._observe("ok", nbytes, sum(p.seconds for p in pushed))
        return JSONResponse({
            "object": "kv_transfer", "transfer_id": tid, "prompt_tokens": handoff.num_prompt_tokens,
            "cached_tokens": handoff.first.cached_tokens, "decode_hit_blocks": res.hit_blocks,
            "blocks_sent": sum(p.blocks for p in pushed), "bytes_sent": nbytes, "parts": len(pushed),
            "reserve_s": round(t1 - t0, 6), "prefill_s": round(t2 - t1, 6), "transfer_s": round(t3 - t2, 6),
        })

    async def _decode(self, prep: Prepared, kvp: KVTransferParams, request: Request,
                      arrival: float) -> Response | EventStreamResponse:
        from kvmesh.engine.disagg.errors import TransferMismatch, UnknownTransfer

        claimed: Future = Future()
        group = self.serving.submit(prep, arrival, DecodeClaim(kvp.transfer_id, claimed))
        try:
            await asyncio.wait_for(asyncio.wrap_future(claimed), self.transfer_timeout_s)
        except TimeoutError:
            self.aengine.release(group)
            # 503: the router starts over on another decode engine (docs/disagg.md).
            raise _err("the engine did not take over the KV transfer in time", 503, "engine_busy",
                       {"Retry-After": "1"}) from None
        except UnknownTransfer as e:
            self.aengine.release(group)
            raise _err(str(e), 409, "transfer_not_found") from None
        except TransferMismatch as e:
            self.aengine.release(group)
            raise _err(str(e), 400, "transfer_mismatch") from None
        except BaseException:
            self.aengine.release(group)
            raise
        return await self.serving.respond_group(prep, group, request)
