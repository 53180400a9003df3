"""The router's ASGI application: OpenAI routes in front of the engine fleet.

A plain ASGI callable rather than a framework app: the hot path is "read body, decide, relay
chunks", and owning ``send`` directly is what lets the proxy hold the response head back
until the engine has produced a first byte (so retries stay invisible to the client).

Routes: POST /v1/completions, /v1/chat/completions; GET /v1/models, /health, /ready, /metrics.

With a prefill pool configured (``RouterSettings.disaggregated``) generation requests run in two
stages (engine/router/disagg.py); without one, each goes to one engine of the pool as is
(``Dispatcher.serve_plain``). Both flows call down into the one ``Dispatcher``
(engine/router/dispatch.py), which owns the pools and does every pick and relay.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvmesh.engine.router import proxy
from kvmesh.engine.router.disagg import FALLBACK_REASONS, STAGE1_OUTCOMES, TwoStageRouter
from kvmesh.engine.router.discovery import Fleet, ServiceSource, SubscriberFactory, default_subscriber_factory
from kvmesh.engine.router.dispatch import Dispatcher
from kvmesh.engine.router.metrics import PDMetrics, RouterMetrics
from kvmesh.engine.router.policies import LoadModel, build_policy, uses_prefix
from kvmesh.engine.router.prompt import CHAT, COMPLETIONS, PromptInfo, analyze, with_cache_salt
from kvmesh.engine.api.tokenize import DETOKENIZE, TOKENIZE
from kvmesh.engine.api.tokenize import answer as tokenize_answer
from kvmesh.engine.router.proxy import all_engines_down, internal_auth
from kvmesh.engine.router.sessions import SessionTable, session_key
from kvmesh.engine.router.slo import ClientClock
from kvmesh.engine.router.tokenizer_fetch import TokenizerFetchError, fetch_tokenizer
from kvmesh.engine.api.auth import AuthGate, Credentials
from kvmesh.engine.api.body_limit import DEFAULT_MAX_REQUEST_BYTES, BodyLimit
from kvmesh.engine.api import errors
from kvmesh.engine.api.params import STATE_HINTS_HEADER, format_state_hints
from kvmesh.engine.api.errors import APIError
from kvmesh.engine.util.asgi import read_body
from kvmesh.engine.util.metrics import render

log = logging.getLogger("kvmesh.router")

OFFLOAD_BODY_BYTES = 4096
"""Bodies longer than this are tokenized on a worker thread (a thread hop costs less than
blocking the event loop for the ~0.3 ms per 1k characters tokenizing takes)."""


@dataclass(frozen=True)
class RouterSettings:
    """``engines``/``services``: the decode (or colocated) pool; ``prefill_engines``/
    ``prefill_services``: the prefill pool, whose presence turns on two-stage serving."""

    policy: str = "cache-aware"
    engines: tuple[str, ...] = ()
    services: tuple[ServiceSource, ...] = ()
    prefill_engines: tuple[str, ...] = ()
    prefill_services: tuple[ServiceSource, ...] = ()
    pd_queue_timeout_s: float = 30.0
    pd_max_queued: int = 256
    session_idle_s: float = 600.0
    load: LoadModel = LoadModel()
    max_attempts: int = 3
    connect_timeout_s: float = 5.0
    resolve_interval_s: float = 5.0
    health_interval_s: float = 2.0
    sync_timeout_s: float = 60.0
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    auth: Credentials = field(default_factory=Credentials)
    """Client keys the router checks, and the internal token it sends every engine (api/auth.py)."""
    ext_proc_port: int | None = None
    """Also serve the pick to Envoy over ext_proc on this port (engine/router/extproc.py; 0: any free one)."""
    ext_proc_host: str = "127.0.0.1"
    ext_proc_front: str = "auto"
    """Who carries the ext_proc streams: "compiled" (engine/router/front/, built on first use),
    "python" (grpc.aio on the router's loop), or "auto" (compiled where it builds, else python)."""

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill_engines or self.prefill_services)


class RouterApp:
    """Holds the fleet, the policy, the sessions and the metrics; ``__call__`` is the ASGI app."""

    def __init__(self, settings: RouterSettings, tokenizer: Any | None = None,
                 fleet_factory: Callable[[aiohttp.ClientSession], Fleet] | None = None,
                 prefill_fleet_factory: Callable[[aiohttp.ClientSession], Fleet] | None = None) -> None:
        self.settings = settings
        self.policy = build_policy(settings.policy, settings.load)
        # A prefix policy routes by prefix only with the engines' tokenizer: given here (read from
        # the model), else fetched from an engine at startup; /ready is 503 until it has one.
        self.needs_tokenizer = uses_prefix(settings.policy)
        self.tokenizer = tokenizer if self.needs_tokenizer else None
        self.tokenizer_problem: str | None = None
        self._tokenizer_task: asyncio.Task | None = None
        self.sessions = SessionTable(idle_s=settings.session_idle_s)
        self._fleet_factory = fleet_factory or self._default_fleet
        self._prefill_fleet_factory = prefill_fleet_factory or self._default_prefill_fleet
        self.metrics = RouterMetrics(settings.policy, lambda: self.fleet.num_healthy() if self.fleet else 0,
                                     self._index_sizes, self._mismatches, self._rates)
        self.dispatch = Dispatcher(settings, self.policy, self.sessions, self.metrics, aiohttp.ClientTimeout(
            total=None, connect=settings.connect_timeout_s, sock_read=None))
        self.two_stage: TwoStageRouter | None = None
        self._bounded = AuthGate(BodyLimit(self._serve_http, settings.max_request_bytes), settings.auth,
                                 on_refused=self.metrics.count_auth_refusal)
        if settings.disaggregated:
            pd = PDMetrics(self.metrics.registry,
                           lambda: self.prefill_fleet.num_healthy() if self.prefill_fleet else 0,
                           lambda: self.two_stage.queued if self.two_stage else 0, STAGE1_OUTCOMES, FALLBACK_REASONS)
            self.two_stage = TwoStageRouter(self.dispatch, pd)
        self._tokenize_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="router-tokenize")
        self.ext_proc: Any = None  # the ExtProcServer while serving (its port: ext_proc.port)

    # The pools and the HTTP session live on the dispatcher (set at startup); read here.
    @property
    def fleet(self) -> Fleet | None:
        """The decode (or colocated) pool."""
        return self.dispatch.fleet

    @property
    def prefill_fleet(self) -> Fleet | None:
        """The prefill pool, only when disaggregated."""
        return self.dispatch.prefill_fleet

    @property
    def session(self) -> aiohttp.ClientSession | None:
        return self.dispatch.session

    def _default_fleet(self, session: aiohttp.ClientSession) -> Fleet:
        s = self.settings
        return Fleet(session, urls=list(s.engines), services=list(s.services), track_kv=self.needs_tokenizer,
                     resolve_interval_s=s.resolve_interval_s, health_interval_s=s.health_interval_s,
                     on_removed=self.sessions.forget_endpoint, subscriber_factory=self._subscriber_factory)

    def _default_prefill_fleet(self, session: aiohttp.ClientSession) -> Fleet:
        s = self.settings
        return Fleet(session, urls=list(s.prefill_engines), services=list(s.prefill_services),
                     track_kv=self.needs_tokenizer, resolve_interval_s=s.resolve_interval_s,
                     health_interval_s=s.health_interval_s, on_removed=self.sessions.forget_endpoint,
                     subscriber_factory=self._subscriber_factory)

    @property
    def _subscriber_factory(self) -> SubscriberFactory:
        return functools.partial(default_subscriber_factory, token=self.settings.auth.internal_token)

    def _fleets(self) -> list[Fleet]:
        return [f for f in (self.prefill_fleet, self.fleet) if f is not None]

    def _index_sizes(self) -> dict[str, Any]:
        # Engine URLs differ between the pools, so one family holds both indexes.
        out: dict[str, Any] = {}
        for f in self._fleets():
            out.update(f.index.size())
            out.update(f.routed.size())  # engines without KV events: the router's own record
        return out

    def _rates(self) -> dict[str, tuple[float | None, float | None]]:
        """Each engine's measured (prefill seconds per token, decode seconds per sequence)."""
        return {st.url: (st.prefill.seconds_per_token(), st.decode_s_per_seq)
                for f in self._fleets() for st in f.engines.values()}

    def _mismatches(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for f in self._fleets():
            out.update(f.mismatches())
        return out

    def ready(self) -> bool:
        """Every configured pool has a healthy engine, every healthy engine's KV state is loaded,
        and a prefix policy has its tokenizer."""
        return (self.fleet is not None and all(f.ready() for f in self._fleets())
                and (self.tokenizer is not None or not self.needs_tokenizer))

    def readiness(self) -> dict[str, Any]:
        """The /ready body: what the operator reports in the CacheAwareRouting condition."""
        return {"ready": self.ready(), "policy": self.settings.policy,
                "tokenizer": self.tokenizer.fingerprint if self.tokenizer is not None else None,
                "tokenizer_problem": self.tokenizer_problem,
                "mismatches": self._mismatches()}

    def _use_tokenizer(self, tokenizer: Any) -> None:
        self.tokenizer, self.tokenizer_problem = tokenizer, None
        for f in self._fleets():
            f.tokenizer = tokenizer.fingerprint

    async def _fetch_tokenizer(self, retry_s: float = 2.0) -> None:
        """Until it has one: the tokenizer of a healthy engine (decode pool first)."""
        assert self.session is not None
        while self.tokenizer is None:
            urls = [st.url for f in reversed(self._fleets()) for st in f.engines.values() if st.healthy]
            try:
                tok, url = await fetch_tokenizer(self.session, urls)
            except TokenizerFetchError as e:
                if self.tokenizer_problem != str(e):
                    log.warning("policy %s needs the engines' tokenizer: %s; /ready stays 503 and requests "
                                "are routed by load until one gives it", self.settings.policy, e)
                self.tokenizer_problem = str(e)
                await asyncio.sleep(retry_s)
                continue
            log.info("tokenizer %s taken from engine %s", tok.fingerprint[:12], url)
            self._use_tokenizer(tok)

    # ---- lifecycle -----------------------------------------------------------------------
    async def startup(self) -> None:
        # One pooled connector for every engine; no per-host cap (the engines queue, not us).
        d = self.dispatch
        d.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=None),
                                          auto_decompress=False, middlewares=internal_auth(self.settings.auth))
        d.fleet = self._fleet_factory(d.session)
        if self.settings.disaggregated:
            d.prefill_fleet = self._prefill_fleet_factory(d.session)
        await asyncio.gather(*(f.start() for f in self._fleets()))
        if self.settings.ext_proc_port is not None:
            from kvmesh.engine.router.front_proc import FrontUnavailable, ext_proc_server

            try:
                server = await ext_proc_server(self)
                await server.start()
            except (OSError, FrontUnavailable):
                await self.shutdown()  # nothing half-started outlives the failed startup
                raise
            self.ext_proc = server
        if self.tokenizer is not None:
            self._use_tokenizer(self.tokenizer)
        elif self.needs_tokenizer:
            self.tokenizer_problem = "no engine asked yet"
            self._tokenizer_task = asyncio.ensure_future(self._fetch_tokenizer())
        synced = await asyncio.gather(*(f.wait_synced(self.settings.sync_timeout_s) for f in self._fleets()))
        if not all(synced):
            log.warning("not every engine's KV snapshot loaded within %.0fs; /ready stays 503 until they do",
                        self.settings.sync_timeout_s)

    async def shutdown(self) -> None:
        if self.ext_proc is not None:
            await self.ext_proc.stop()
        if self._tokenizer_task is not None:
            self._tokenizer_task.cancel()
        for f in self._fleets():
            await f.stop()
        if self.session is not None:
            await self.session.close()
        self._tokenize_pool.shutdown(wait=False)

    async def _lifespan(self, receive: Callable[[], Any], send: proxy.Send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as e:  # noqa: BLE001 - reported to the server, which exits
                    log.exception("router startup failed")
                    await send({"type": "lifespan.startup.failed", "message": str(e)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # ---- ASGI ----------------------------------------------------------------------------
    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Any], send: proxy.Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] == "http":
            await self._bounded(scope, receive, send)

    async def _serve_http(self, scope: dict[str, Any], receive: Callable[[], Any], send: proxy.Send) -> None:
        path, method = scope["path"], scope["method"]
        try:
            if path in (COMPLETIONS, CHAT):
                if method != "POST":
                    raise errors.method_not_allowed(method, path)
                await self._generate(scope, receive, send, path)
            elif path in (TOKENIZE, DETOKENIZE):
                if method != "POST":
                    raise errors.method_not_allowed(method, path)
                await self._tokenize(path, await read_body(receive), send)
            elif method != "GET":
                raise errors.method_not_allowed(method, path) if path in _GET_ROUTES else errors.route_not_found(path)
            elif path == "/health":
                await proxy.send_json(send, 200, b'{"status":"ok"}')
            elif path == "/ready":
                body = self.readiness()
                await proxy.send_json(send, 200 if body["ready"] else 503, json.dumps(body).encode())
            elif path == "/metrics":
                body, ctype = render(self.metrics.registry)
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", ctype.encode())]})
                await send({"type": "http.response.body", "body": body})
            elif path == "/v1/models" or path.startswith("/v1/models/"):
                await self._models(path, send)
            else:
                raise errors.route_not_found(path)
        except APIError as e:
            await proxy.send_error(send, e)

    async def _models(self, path: str, send: proxy.Send) -> None:
        await self._relay("GET", path, None, send)

    async def _tokenize(self, path: str, body: bytes, send: proxy.Send) -> None:
        """Answered here with the engines' tokenizer when the router holds it and knows the names
        and context length the engines serve (their /kv/info); else relayed to an engine."""
        assert self.fleet is not None
        infos = [st.info for st in self.fleet.engines.values() if st.healthy and st.info]
        # /kv/info comes from the network: only well-typed values count.
        names = sorted({n for i in infos if isinstance(i.get("served_model_names"), list)
                        for n in i["served_model_names"] if isinstance(n, str)})
        if self.tokenizer is None or not names:
            await self._relay("POST", path, body, send)
            return
        lengths = [i["max_model_len"] for i in infos
                   if isinstance(i.get("max_model_len"), int) and not isinstance(i["max_model_len"], bool)]
        run = functools.partial(tokenize_answer, path, body, self.tokenizer, names, min(lengths) if lengths else None)
        out = (await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, run)
               if len(body) > OFFLOAD_BODY_BYTES else run())
        await proxy.send_json(send, 200, json.dumps(out).encode())

    async def _relay(self, method: str, path: str, body: bytes | None, send: proxy.Send) -> None:
        """The answer of the least busy healthy engine to a request that needs no routing."""
        assert self.fleet is not None and self.session is not None
        tried = []
        for ep in sorted(self.fleet.endpoints(), key=lambda e: e.running):
            if not ep.healthy:
                continue
            try:
                async with self.session.request(method, ep.id + path, data=body, timeout=self.dispatch.timeout,
                                                headers={"content-type": "application/json"} if body else None) as r:
                    body = await r.read()
                    await proxy.send_json(send, r.status, body)
                    return
            except proxy.UPSTREAM_ERRORS as e:
                self.fleet.mark_failed(ep.id, str(e))
                tried.append(f"{ep.id}: {type(e).__name__}")
        raise all_engines_down(tried)

    # ---- generation ----------------------------------------------------------------------
    async def _generate(self, scope: dict[str, Any], receive: Callable[[], Any], send: proxy.Send,
                        path: str) -> None:
        body = await read_body(receive)
        task = asyncio.ensure_future(self._serve(scope, body, send, path))
        disconnect = asyncio.ensure_future(self._wait_disconnect(receive, task))
        try:
            await task
        except asyncio.CancelledError:
            if not task.cancelled():
                raise
        finally:
            disconnect.cancel()

    @staticmethod
    async def _wait_disconnect(receive: Callable[[], Any], task: asyncio.Future) -> None:
        while not task.done():
            msg = await receive()
            if msg["type"] == "http.disconnect":
                task.cancel()  # closes the upstream connection: the engine aborts the request
                return

    async def prepare(self, path: str, body: bytes, authorization: bytes | str | None) -> tuple[bytes, PromptInfo]:
        """(the body to send upstream, its routing view): with ``--isolate-tenants`` the tenant's
        cache salt goes into the body first, so the hash chain is the tenant's; the prompt is
        tokenized and hashed as the engines do. Shared by the proxy and the ext_proc picker, so
        both pick from the same prompt view."""
        now = self.prepare_now(path, body, authorization)
        if now is not None:
            return now
        # Long prompts take milliseconds to tokenize; the Rust tokenizer releases the GIL, so a
        # worker thread keeps the loop relaying other requests' chunks meanwhile.
        body = self._salted(body, authorization)
        info = await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, analyze, path, body,
                                                                self.tokenizer)
        return body, info

    def prepare_now(self, path: str, body: bytes, authorization: bytes | str | None) -> tuple[bytes, PromptInfo] | None:
        """``prepare``'s answer where it takes no worker thread (a short body), else None."""
        if self.tokenizer is not None and len(body) > OFFLOAD_BODY_BYTES:
            return None
        body = self._salted(body, authorization)
        return body, analyze(path, body, self.tokenizer)

    def _salted(self, body: bytes, authorization: bytes | str | None) -> bytes:
        auth = self.settings.auth
        if auth.isolate_tenants:  # before hashing: the router's index sees the tenant's chain
            body = with_cache_salt(body, lambda own: auth.cache_salt(authorization, own))
        return body

    async def _serve(self, scope: dict[str, Any], body: bytes, send: proxy.Send, path: str) -> None:
        assert self.fleet is not None and self.session is not None
        t0 = time.perf_counter()
        authorization = next((v for k, v in scope["headers"] if k.lower() == b"authorization"), None)
        body, info = await self.prepare(path, body, authorization)
        headers = proxy.forward_headers(scope["headers"])
        # Hybrid engines: where to checkpoint, from what the pool computing the prompt reported.
        hints = (self.prefill_fleet if self.prefill_fleet is not None else self.fleet).state_hints(info)
        if hints:
            headers[STATE_HINTS_HEADER] = format_state_hints(hints)
        session = session_key(headers, info.user) if self.settings.policy == "session" else None
        clock = ClientClock(t0)  # end-to-end TTFT/TPOT, whichever path answers (engine/router/slo.py)
        send = clock.wrap(send)
        try:
            if self.two_stage is not None:
                await self.two_stage.serve(info, body, headers, send, path, session, t0)
            else:
                await self.dispatch.serve_plain(info, body, headers, send, path, session, t0)
        finally:
            self.metrics.observe_client(clock)

_GET_ROUTES = frozenset({"/health", "/ready", "/metrics", "/v1/models"})


def create_router_app(settings: RouterSettings, tokenizer: Any | None = None) -> RouterApp:
    return RouterApp(settings, tokenizer)


__all__ = ["RouterApp", "RouterSettings", "create_router_app", "all_engines_down"]
