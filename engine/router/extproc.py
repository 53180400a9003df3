"""`kvmesh router --ext-proc-port`: the router's pick served to Envoy as an ext_proc endpoint picker.

A gRPC server (grpc.aio, on the router's own event loop, so it reads and updates the same fleet,
index, sessions and engine load as the HTTP proxy without locks) with two services:
- ``envoy.service.ext_proc.v3.ExternalProcessor``: one ``Process`` stream per HTTP request, run
  by ``PickerStream`` (engine/router/extproc_stream.py), and, where the gateway follows the
  response with a second filter in observability mode, one more stream per request that feeds the
  response to the pick it names (``ObserverStream``, engine/router/extproc_observe.py);
- ``grpc.health.v1.Health``: SERVING (for "" and the ext_proc service name) exactly while the
  router's ``/ready`` would answer 200, re-checked every ``HEALTH_EVERY_S``.

A stream that ends for any reason (the request is over, the client left and Envoy cancelled the
stream, the gateway died) releases what its request held on an engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from kvmesh.engine.api import errors
from kvmesh.engine.router.extproc_observe import ObserverStream, PendingPicks
from kvmesh.engine.router.extproc_stream import PickerStream

if TYPE_CHECKING:
    from kvmesh.engine.router.app import RouterApp

log = logging.getLogger("kvmesh.router.extproc")

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_EVERY_S = 0.5


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    def __init__(self, app: RouterApp) -> None:
        self.app = app
        self.picks = PendingPicks()

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],  # noqa: N802 - gRPC's name
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ProcessingResponse]:
        messages = aiter(request_iterator)
        first = await anext(messages, None)
        if first is None:
            return
        if first.observability_mode:
            await self._observe(first, messages)
            return
        stream = PickerStream(self.app, picks=self.picks)
        clean = False
        try:
            req: pb.ProcessingRequest | None = first
            while req is not None:
                try:
                    answers = await stream.handle(req)
                except Exception as e:  # noqa: BLE001 - a bug must cost one request, never the picker
                    log.exception("ext_proc message handling failed")
                    answers = [] if stream.refused else stream.refuse(
                        errors.internal_error(f"the picker failed on this request ({type(e).__name__})"))
                for answer in answers:
                    yield answer
                req = await anext(messages, None)
            clean = True
        finally:
            stream.close(clean)

    async def _observe(self, first: pb.ProcessingRequest, rest: AsyncIterator[pb.ProcessingRequest]) -> None:
        """An observability-mode stream: the response of a pick made on another stream."""
        observer = ObserverStream(self.picks)
        try:
            req: pb.ProcessingRequest | None = first
            while req is not None:
                try:
                    observer.handle(req)
                except Exception:  # noqa: BLE001 - a bug must cost one request's accounting, never the picker
                    log.exception("ext_proc observer message handling failed")
                req = await anext(rest, None)
        finally:
            observer.close()


class ExtProcServer:
    """The gRPC server; ``start`` binds ``host:port`` (0: any free port) and returns the port."""

    def __init__(self, app: RouterApp, host: str, port: int) -> None:
        self.app, self.host, self.port = app, host, port
        self.server: grpc.aio.Server | None = None
        self.processor = ExternalProcessor(app)
        self.health = health_aio.HealthServicer()
        self._health_task: asyncio.Task | None = None

    async def start(self) -> int:
        server = self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_ExternalProcessorServicer_to_server(self.processor, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        target = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        try:
            bound = server.add_insecure_port(target)
        except RuntimeError:  # grpc's way of saying the bind failed
            bound = 0
        if not bound:
            raise OSError(f"--ext-proc-port: cannot listen on {target}: the port is in use or the address is not "
                          "this host's; pick another --ext-proc-port (or --host)")
        self.port = bound
        await server.start()
        await self._publish_health()
        self._health_task = asyncio.create_task(self._health_loop(), name="ext_proc health")
        log.info("ext_proc endpoint picker listening on %s:%d", self.host, bound)
        return bound

    async def _publish_health(self) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if self.app.ready() else \
            health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE):
            await self.health.set(name, status)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_EVERY_S)
            await self._publish_health()

    async def stop(self, grace_s: float = 5.0) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self.server is not None:
            await self.server.stop(grace_s)
