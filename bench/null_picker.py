"""An ext_proc endpoint picker that costs nothing: it routes every request to one fixed endpoint the
moment the body is whole, with no tokenizing, no index and no accounting. Behind Envoy it measures
the floor of any picker written on Python's grpc.aio, so that bench/gateway.py can split what the
kvmesh picker adds into that floor and the pick itself.

  python bench/null_picker.py PORT DESTINATION_IP:PORT
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from kvmesh.engine.router import epp


class NullPicker(pb_grpc.ExternalProcessorServicer):
    def __init__(self, destination: str) -> None:
        self.pick = epp.Pick(destination)

    async def Process(self, messages: AsyncIterator[pb.ProcessingRequest],  # noqa: N802 - gRPC's name
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ProcessingResponse]:
        mode = epp.BODY_NONE
        async for req in messages:
            if req.observability_mode:
                continue  # an observer stream: nothing to answer
            if req.HasField("protocol_config"):
                mode = req.protocol_config.request_body_mode
            kind = req.WhichOneof("request")
            if kind == "request_headers" and mode == epp.BODY_BUFFERED:
                yield epp.empty("request_headers")
            elif kind == "request_body" and req.request_body.end_of_stream:
                if mode == epp.BODY_BUFFERED:
                    yield epp.buffered_answer(self.pick)
                else:
                    yield epp.headers_answer(self.pick)
                    yield epp.streamed_body(req.request_body.body, True)
            elif kind == "request_trailers":
                yield epp.empty("request_trailers")


async def serve(port: int, destination: str) -> None:
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(NullPicker(destination), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(serve(int(sys.argv[1]), sys.argv[2]))
