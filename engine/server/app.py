"""The FastAPI application: routes, error mapping, lifespan.

Routes stay thin: parse, delegate to `Serving`, let `APIError` propagate to
one handler that answers in OpenAI's error format and counts the error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from kvmesh.engine.kv.event_publisher import KVEventPublisher
from kvmesh.engine.api import errors
from kvmesh.engine.api.body_limit import DEFAULT_MAX_REQUEST_BYTES, BodyLimit
from kvmesh.engine.server.async_engine import AsyncEngine, ServerState
from kvmesh.engine.server.disagg import DisaggServing
from kvmesh.engine.server.drain import MAX_DRAIN_LEASE_S, Drainer
from kvmesh.engine.api.auth import AuthGate, Credentials, bearer, forbidden, unauthorized
from kvmesh.engine.api.errors import APIError
from kvmesh.engine.server.generation import Serving
from kvmesh.engine.server.kv_routes import add_kv_routes
from kvmesh.engine.server.metrics import ServerMetrics
from kvmesh.engine.util.metrics import render
from kvmesh.engine.api.protocol import ChatCompletionRequest, CompletionRequest
from kvmesh.engine.api.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from kvmesh.engine.transfer.ucx_env import stop_ucx_notifier

log = logging.getLogger("kvmesh.server")


class ServerApp:
    """Everything one server process holds: the async engine, metrics, the app."""

    def __init__(self, aengine: AsyncEngine, served_model_names: list[str] | None = None,
                 kv_publisher: KVEventPublisher | None = None, drain_timeout_s: float = 30.0,
                 role: str = "both", kv_transfer_port: int = 0, kv_transfer_host: str = "0.0.0.0",
                 kv_transfer_timeout_s: float = 30.0,
                 kv_transfer_overlap: bool = True, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 auth: Credentials | None = None, kv_transfer_tail_tokens: int = 0) -> None:
        """`kv_publisher`, when given, streams the engine's KV events from load to shutdown;
        `drain_timeout_s` bounds a drain (SIGTERM or POST /admin/drain) before leftovers are aborted;
        `role` prefill/decode adds the KV handoff (docs/disagg.md), decode listening for KV on
        `kv_transfer_host`:`kv_transfer_port` (0: any free port, reported by /kv/info); a request body over
        `max_request_bytes` gets 413 before it is read; `auth` (api/auth.py) refuses callers without
        the credential a path needs before that (``app`` is the guarded, bounded ASGI app)."""
        self.aengine = aengine
        self.drainer = Drainer(aengine, drain_timeout_s)
        self.kv_publisher = kv_publisher
        self._names_override = list(served_model_names or [])
        self.started = int(time.time())
        self.metrics = ServerMetrics(self._names_override[0] if self._names_override else "", 0,
                                     stats=lambda: aengine.stats, ready=lambda: aengine.ready)
        aengine.on_finished = self.metrics.observe_finished
        aengine.on_token_gap = self.metrics.observe_token_gap
        aengine.on_dispatch_lag = self.metrics.observe_dispatch_lag
        self.serving = Serving(aengine, [], count_error=self.metrics.count_error)
        self.disagg = DisaggServing(role, aengine, self.serving, transfer_port=kv_transfer_port,
                                    transfer_host=kv_transfer_host,
                                    transfer_timeout_s=kv_transfer_timeout_s, overlap=kv_transfer_overlap,
                                    tail_tokens=kv_transfer_tail_tokens,
                                    observe=self.metrics.observe_handoff, token=lambda: self.auth.internal_token())
        self.auth = auth or Credentials()
        self.metrics.transfer_auth_failures = lambda: self.disagg.auth_failures
        self.metrics.transfer_header_mismatches = lambda: self.disagg.header_mismatches
        self.app = AuthGate(BodyLimit(self._build(), max_request_bytes,
                                      on_refused=lambda e: self.metrics.count_error(e.code)),
                            self.auth, on_refused=self.metrics.count_auth_refusal)

    def served_names(self) -> list[str]:
        """--served-model-name values if given; else the model's own name first, then the
        name the server was started with (`--model default`, a path) as an alias."""
        if self._names_override:
            return self._names_override
        engine = self.aengine.engine
        if engine is None:
            return []
        return list(dict.fromkeys([engine.model_config.name, engine.config.model]))

    def _on_loaded(self) -> None:
        names = self.served_names()
        self.serving.served_names = names
        engine = self.aengine.engine
        choice = getattr(engine, "dtype_choice", None)  # a test's fake engine may have none
        self.metrics.set_model(names[0], engine.config.block_size, choice.dtype if choice else "",
                               choice.source if choice else "", str(getattr(engine, "device", "")))
        if self.kv_publisher is not None:
            self.kv_publisher.start(self.aengine.engine.events, model=names[0])
        self.disagg.on_loaded()

    def _build(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            if self.kv_publisher is not None:
                self.kv_publisher.bind()  # fail before the model load, not after it
            self.aengine.add_load_callback(self._on_loaded)
            self.aengine.start()
            try:
                yield
            finally:
                await self.aengine.shutdown()
                await asyncio.to_thread(self.disagg.close)
                close_engine = getattr(self.aengine.engine, "close", None)  # the cache-node link, if any
                if close_engine is not None:
                    await asyncio.to_thread(close_engine)
                await asyncio.to_thread(stop_ucx_notifier)
                if self.kv_publisher is not None:
                    await asyncio.to_thread(self.kv_publisher.close)

        app = FastAPI(title="kvmesh engine", lifespan=lifespan, docs_url=None, redoc_url=None)
        app.state.server = self
        self._add_error_handlers(app)
        self._add_routes(app)
        add_kv_routes(app, self.aengine, self.kv_publisher,
                      lambda: {**self.disagg.info(), "served_model_names": self.served_names()})
        return app

    # ---- errors ------------------------------------------------------------------------
    def _error_response(self, err: APIError) -> JSONResponse:
        self.metrics.count_error(err.code)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    def _add_error_handlers(self, app: FastAPI) -> None:
        @app.exception_handler(APIError)
        async def _api_error(_: Request, exc: APIError) -> JSONResponse:
            return self._error_response(exc)

        @app.exception_handler(RequestValidationError)
        async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
            return self._error_response(errors.from_validation_errors(list(exc.errors())))

        @app.exception_handler(StarletteHTTPException)
        async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
            if exc.status_code == 404:
                err = errors.route_not_found(request.url.path)
            elif exc.status_code == 405:
                err = errors.method_not_allowed(request.method, request.url.path)
            else:
                err = APIError(str(exc.detail), exc.status_code, "invalid_request_error", "http_error")
            return self._error_response(err)

        @app.exception_handler(Exception)
        async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
            log.exception("unhandled error")
            return self._error_response(errors.internal_error(f"{type(exc).__name__}: {exc}"))

    # ---- routes ------------------------------------------------------------------------
    def _add_routes(self, app: FastAPI) -> None:
        aengine, serving = self.aengine, self.serving

        @app.get("/health")
        async def health() -> JSONResponse:
            # Alive unless the engine died (then a restart is the fix).
            ok = aengine.state is not ServerState.FAILED
            return JSONResponse({"status": "ok" if ok else "failed", "state": aengine.state.value},
                                status_code=200 if ok else 503)

        @app.get("/ready")
        async def ready() -> JSONResponse:
            # engine_id changes when the engine restarts: a router that sees a new one resyncs
            # its view of this engine's cache (kvmesh.engine.router.discovery).
            engine = aengine.engine if aengine.loaded.is_set() else None
            return JSONResponse({"ready": aengine.ready, "state": aengine.state.value,
                                 "engine_id": getattr(engine, "engine_id", None)},
                                status_code=200 if aengine.ready else 503)

        @app.post("/admin/drain")
        async def start_drain(lease_s: float | None = Query(None, gt=0, le=MAX_DRAIN_LEASE_S)) -> JSONResponse:
            # Same drain as SIGTERM, without exiting: the operator drains a victim,
            # waits for in_flight 0, then removes the pod. It renews the lease on every tick.
            self.drainer.start("POST /admin/drain", lease_s=lease_s)
            return JSONResponse(self.drainer.status(), status_code=202)

        @app.get("/admin/drain")
        async def drain_status() -> JSONResponse:
            return JSONResponse(self.drainer.status())

        @app.delete("/admin/drain")
        async def cancel_drain() -> JSONResponse:
            # The operator scaled the pool up while this pod drained: it serves again.
            if not self.drainer.cancel():
                raise APIError("this server is shutting down (SIGTERM); its drain cannot be cancelled", 409,
                               "invalid_request_error", "shutting_down")
            return JSONResponse(self.drainer.status())

        @app.get("/metrics")
        async def metrics() -> Response:
            body, content_type = render(self.metrics.registry)
            return Response(body, media_type=content_type)

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [self._model_card(n) for n in self._loaded_names()]}

        @app.get("/v1/models/{model:path}")
        async def model(model: str) -> dict[str, Any]:
            names = self._loaded_names()
            if model not in names:
                raise errors.model_not_found(model, names)
            return self._model_card(model)

        @app.post("/v1/completions")
        async def completions(body: CompletionRequest, request: Request) -> Any:
            arrival = time.monotonic()
            aengine.check_accepting(0)
            body.cache_salt = self.auth.cache_salt(request.headers.get("authorization"), body.cache_salt)
            if body.kv_transfer_params is not None:
                self._check_internal(request)
            prep = await serving.compile_grammar(serving.prepare_completion(body, request.headers))
            if body.kv_transfer_params is not None:
                return await self.disagg.respond(prep, body.kv_transfer_params, request, arrival)
            return await serving.respond(prep, request, arrival)

        @app.post("/v1/chat/completions")
        async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
            arrival = time.monotonic()
            aengine.check_accepting(0)
            body.cache_salt = self.auth.cache_salt(request.headers.get("authorization"), body.cache_salt)
            if body.kv_transfer_params is not None:
                self._check_internal(request)
            prep = await serving.compile_grammar(serving.prepare_chat(body, request.headers))
            if body.kv_transfer_params is not None:
                return await self.disagg.respond(prep, body.kv_transfer_params, request, arrival)
            return await serving.respond(prep, request, arrival)

        @app.post("/tokenize")
        async def tokenize_route(body: TokenizeRequest) -> dict[str, Any]:
            engine = self._loaded_engine(body.model)
            return tokenize(engine.tokenizer, body, engine.max_model_len)

        @app.post("/detokenize")
        async def detokenize_route(body: DetokenizeRequest) -> dict[str, Any]:
            return detokenize(self._loaded_engine(body.model).tokenizer, body)

    def _loaded_engine(self, model: str | None) -> Any:
        """The engine, once loaded and when ``model`` (if given) is one of its served names."""
        names = self._loaded_names()
        if model and model not in names:
            raise errors.model_not_found(model, names)
        return self.aengine.engine

    def _check_internal(self, request: Request) -> None:
        """A request carrying ``kv_transfer_params`` drives the prefill/decode internals: with an
        internal token set only a caller holding it (the router) may send one."""
        if self.auth.token is None:
            return
        cred = bearer(request.headers.get("authorization"))
        if not self.auth.is_internal(cred):
            self.metrics.count_auth_refusal("internal", 403 if cred else 401)
            raise (forbidden if cred else unauthorized)(
                "kv_transfer_params is for the router: it needs the deployment's internal token")

    def _loaded_names(self) -> list[str]:
        if self.aengine.engine is None:
            if self.aengine.state is ServerState.FAILED:
                raise errors.engine_failed(str(self.aengine.failure))
            raise errors.not_ready()
        return self.served_names()

    def _model_card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.started, "owned_by": "kvmesh",
                "max_model_len": self.aengine.engine.max_model_len}


def create_app(aengine: AsyncEngine, served_model_names: list[str] | None = None) -> FastAPI:
    """The ASGI app serving `aengine` (started and stopped by the app's lifespan)."""
    return ServerApp(aengine, served_model_names).app
