"""Envoy ext_proc messages as the picker receives them, and a router app whose fleet is two engine
states marked healthy by hand (nothing is contacted: the picker only decides). Shared by the picker's
message-level tests (tests/router/test_extproc_stream.py, test_extproc_observe.py).

Real: Envoy's own ext_proc protobuf messages (xds-protos) and ``RouterApp``. Fake: the tokenizer
(tests/support/fake_step_engine.py's byte tokenizer) and the engines.
"""

from __future__ import annotations

import asyncio
import json

import hypothesis.strategies as st
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from kvmesh.engine.router import epp
from kvmesh.engine.router.app import RouterApp, RouterSettings
from kvmesh.engine.router.discovery import EngineState, Fleet
from kvmesh.engine.router.extproc_stream import PickerStream
from kvmesh.engine.router.policies import LoadModel
from tests.support.fake_http_engine import BLOCK_SIZE, EXTRA
from tests.support.fake_step_engine import FakeTokenizer

URLS = ("http://10.0.0.1:8000", "http://10.0.0.2:8000")
ADDRS = ("10.0.0.1:8000", "10.0.0.2:8000")
LIMIT = 64 << 10


def make_app(policy: str = "cache-aware", shed: int = 0, kv_events: bool = True) -> RouterApp:
    """``kv_events``: the engines say they publish KV events (their prefixes are what the tests put
    in the index); False: they publish none, and the router's record of its picks stands in."""
    settings = RouterSettings(policy=policy, engines=URLS, max_request_bytes=LIMIT,
                              load=LoadModel(shed_running=shed))
    app = RouterApp(settings, FakeTokenizer())
    fleet = Fleet(session=None, urls=list(URLS))  # type: ignore[arg-type] - the picker never does I/O
    for u in URLS:
        fleet.engines[u] = EngineState(u, healthy=True, info={"block_size": BLOCK_SIZE, "extra_key": EXTRA.hex(),
                                                              "kv_events": {"port": 1} if kv_events else None})
    app.dispatch.fleet = fleet
    return app


def config(request_mode: int, response_mode: int = epp.BODY_STREAMED) -> pb.ProtocolConfiguration:
    return pb.ProtocolConfiguration(request_body_mode=request_mode, response_body_mode=response_mode)


def headers_msg(headers: dict[str, str], eos: bool = False, mode: int | None = None,
                subset: list[str] | None = None) -> pb.ProcessingRequest:
    hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()])
    req = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hm, end_of_stream=eos))
    if mode is not None:
        req.protocol_config.CopyFrom(config(mode))
    if subset is not None:
        s = struct_pb2.Struct()
        s.update({epp.SUBSET_KEY: subset})
        req.metadata_context.filter_metadata[epp.SUBSET_NAMESPACE].CopyFrom(s)
    return req


def body_msg(body: bytes, eos: bool = True) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=eos))


def response_headers(status: int = 200, served: str | None = None, ctype: str = "text/event-stream",
                     eos: bool = False) -> pb.ProcessingRequest:
    hs = {":status": str(status), "content-type": ctype, **({epp.SERVED: served} if served else {})}
    hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in hs.items()])
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=hm, end_of_stream=eos))


def response_body(body: bytes, eos: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=body, end_of_stream=eos))


POST = {":method": "POST", ":path": "/v1/chat/completions", "content-type": "application/json"}


def chat_body(text: str, model: str | None = "m") -> bytes:
    doc = {"messages": [{"role": "user", "content": text}], **({"model": model} if model else {})}
    return json.dumps(doc).encode()


def run(stream: PickerStream, *msgs: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
    async def go() -> list[pb.ProcessingResponse]:
        out = []
        for m in msgs:
            out += await stream.handle(m)
        return out

    return asyncio.run(go())


def destination(resp: pb.ProcessingResponse) -> str:
    kind = resp.WhichOneof("response")
    common = getattr(resp, kind).response
    (h,) = [h.header for h in common.header_mutation.set_headers if h.header.key == epp.DESTINATION]
    meta = resp.dynamic_metadata.fields[epp.LB_NAMESPACE].struct_value.fields[epp.DESTINATION].string_value
    assert meta == h.raw_value.decode() and common.clear_route_cache
    return meta


def load(app: RouterApp) -> dict[str, tuple[int, int]]:
    return {u: (s.inflight, s.queued_prefill_tokens) for u, s in app.fleet.engines.items()}


# ---- fuzz strategies ---------------------------------------------------------------
KINDS = ("request_headers", "request_body", "request_trailers", "response_headers", "response_body",
          "response_trailers", "none")
_header = st.tuples(st.sampled_from([":method", ":path", ":status", "content-length", "content-type",
                                     "authorization", "x-session-id", epp.SERVED, "x-other"]),
                    st.one_of(st.text(max_size=30), st.sampled_from(["POST", "/v1/chat/completions", "200",
                                                                     "text/event-stream", ADDRS[0], "99999999"])))
_body = st.one_of(st.binary(max_size=200), st.sampled_from([chat_body("hi"), chat_body("hi", None), b"{}",
                                                             b'{"model": 1}', b"null", b"data: {}\n\n"]))


@st.composite
def message(draw) -> pb.ProcessingRequest:
    kind = draw(st.sampled_from(KINDS))
    req = pb.ProcessingRequest()
    if draw(st.booleans()):
        req.protocol_config.CopyFrom(config(draw(st.integers(0, 6)), draw(st.integers(0, 6))))
    if draw(st.booleans()):
        s = struct_pb2.Struct()
        s.update({epp.SUBSET_KEY: draw(st.one_of(st.lists(st.sampled_from(ADDRS + ("x", ""))), st.text(max_size=20),
                                                   st.floats(allow_nan=False), st.booleans()))})
        req.metadata_context.filter_metadata[epp.SUBSET_NAMESPACE].CopyFrom(s)
    eos = draw(st.booleans())
    if kind in ("request_headers", "response_headers"):
        hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode("utf-8", "replace"))
                                         for k, v in draw(st.lists(_header, max_size=6))])
        getattr(req, kind).CopyFrom(pb.HttpHeaders(headers=hm, end_of_stream=eos))
    elif kind in ("request_body", "response_body"):
        getattr(req, kind).CopyFrom(pb.HttpBody(body=draw(_body), end_of_stream=eos))
    elif kind != "none":
        getattr(req, kind).CopyFrom(pb.HttpTrailers())
    return req
