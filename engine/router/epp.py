"""The endpoint picker protocol (Gateway API Inference Extension) over Envoy's ext_proc messages.

Pure functions from ext_proc messages to what the picker needs (headers, the candidate subset,
the endpoint that served) and from a decision to the messages Envoy applies (the destination
header, the ``envoy.lb`` dynamic metadata, an immediate response). No I/O, no clocks: the stream
state machine (engine/router/extproc.py) calls these.

Protocol facts relied on (GIE's endpoint picker protocol):
- the picked endpoint is ``IP:PORT`` (``[v6]:PORT``) in the request header
  ``x-gateway-destination-endpoint`` *and* in dynamic metadata ``envoy.lb`` under the same key;
- the gateway may restrict candidates with metadata ``envoy.lb.subset_hint`` /
  ``x-gateway-destination-endpoint-subset`` (a list of ``IP:PORT``, or one comma-separated string);
- the endpoint that actually served comes back as response header (or ``envoy.lb`` metadata)
  ``x-gateway-destination-endpoint-served``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import msgspec
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from kvmesh.engine.api.errors import APIError

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
PICK_ID = "x-kvmesh-pick"  # kvmesh's own: names a pick to the observer filter (extproc_observe.py)

# ProcessingMode.BodySendMode values (envoy/extensions/filters/http/ext_proc/v3/processing_mode.proto).
BODY_NONE, BODY_STREAMED, BODY_BUFFERED, BODY_BUFFERED_PARTIAL, BODY_FULL_DUPLEX = 0, 1, 2, 3, 4
BODY_MODE_NAMES = {BODY_NONE: "NONE", BODY_STREAMED: "STREAMED", BODY_BUFFERED: "BUFFERED",
                   BODY_BUFFERED_PARTIAL: "BUFFERED_PARTIAL", BODY_FULL_DUPLEX: "FULL_DUPLEX_STREAMED"}


EMPTY_MESSAGE = "empty ext_proc message: it carries no headers, body or trailers"


class ProtocolError(ValueError):
    """The gateway sent something the picker cannot act on; the message says what to change."""


def header_map(headers: pb.HttpHeaders) -> dict[str, str]:
    """Lower-cased name -> value of an ext_proc header map (``raw_value`` when ``value`` is
    empty, as Envoy sends it with ``send_raw_value``). Undecodable bytes become U+FFFD rather
    than an error: a header value never decides whether the picker answers."""
    out: dict[str, str] = {}
    for h in headers.headers.headers:
        value = h.value or h.raw_value.decode("utf-8", "replace")
        out[h.key.lower()] = value
    return out


def endpoint_address(url: str) -> str:
    """An engine base URL as the ``IP:PORT`` the gateway connects to (``[v6]:PORT`` for IPv6)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def subset_hint(metadata: base_pb2.Metadata) -> frozenset[str] | None:
    """The candidate endpoints the gateway allows (None: no hint, every endpoint may be picked)."""
    ns = metadata.filter_metadata.get(SUBSET_NAMESPACE)
    if ns is None or SUBSET_KEY not in ns.fields:
        return None
    value = ns.fields[SUBSET_KEY]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return subset_of([v.string_value for v in value.list_value.values if v.WhichOneof("kind") == "string_value"])
    if kind == "string_value":
        return subset_of(value.string_value)
    raise _bad_subset(kind or "empty value")


def subset_of(value: object) -> frozenset[str]:
    """The candidates from the hint's value as JSON has it (the compiled front sends it so): a
    list of ``IP:PORT`` strings (other items ignored) or one comma-separated string."""
    if isinstance(value, str):
        items: Iterable[str] = value.split(",")
    elif isinstance(value, list):
        items = (v for v in value if isinstance(v, str))
    else:
        raise _bad_subset({dict: "struct_value", bool: "bool_value", type(None): "null_value"}.get(
            type(value), "number_value"))
    return frozenset(i.strip() for i in items if i.strip())


def _bad_subset(kind: str) -> ProtocolError:
    return ProtocolError(f"metadata {SUBSET_NAMESPACE}/{SUBSET_KEY} must be a list of IP:PORT strings, got a {kind}")


def served_endpoint(headers: Mapping[str, str], metadata: base_pb2.Metadata) -> str | None:
    """The ``IP:PORT`` that served the response, from the response header or ``envoy.lb`` metadata."""
    got = headers.get(SERVED)
    if got:
        return got.strip()
    ns = metadata.filter_metadata.get(LB_NAMESPACE)
    if ns is not None and SERVED in ns.fields and ns.fields[SERVED].WhichOneof("kind") == "string_value":
        return ns.fields[SERVED].string_value.strip() or None
    return None


def request_path(headers: Mapping[str, str]) -> str:
    """``:path`` without its query string."""
    return headers.get(":path", "/").split("?", 1)[0]


def _set(headers: Iterable[tuple[str, str]]) -> list[base_pb2.HeaderValueOption]:
    return [base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=v.encode("latin-1", "replace")),
                                       append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)
            for k, v in headers]


def destination_metadata(address: str) -> struct_pb2.Struct:
    """``{"envoy.lb": {"x-gateway-destination-endpoint": address}}``."""
    s = struct_pb2.Struct()
    s.update({LB_NAMESPACE: {DESTINATION: address}})
    return s


@dataclass(frozen=True)
class Pick:
    """The picker's answer for one request: where it goes, and the body to send if it changed
    (``--isolate-tenants`` salts it) or must be echoed (full-duplex mode echoes the whole body)."""

    address: str
    body: bytes | None = None  # the new body (None: unchanged)
    pick_id: str = ""  # names the pick to an observer filter (engine/router/extproc_observe.py)
    headers: tuple[tuple[str, str], ...] = ()  # more request headers for the engine (state hints)


def pick_mutation(pick: Pick) -> pb.CommonResponse:
    """The request-header mutation that routes to ``pick.address`` (and fixes the length of a
    changed body); ``clear_route_cache`` so a route keyed on the header sees it."""
    sets = [(DESTINATION, pick.address), *pick.headers]
    if pick.pick_id:
        sets.append((PICK_ID, pick.pick_id))
    if pick.body is not None:
        sets.append(("content-length", str(len(pick.body))))
    return pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=_set(sets)), clear_route_cache=True)


def buffered_answer(pick: Pick) -> pb.ProcessingResponse:
    """BUFFERED mode: the answer to the whole-body message (headers were answered empty)."""
    common = pick_mutation(pick)
    if pick.body is not None:
        common.body_mutation.body = pick.body
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common),
                                 dynamic_metadata=destination_metadata(pick.address))


def headers_answer(pick: Pick) -> pb.ProcessingResponse:
    """The answer to the request headers that routes (full-duplex mode, or a request without body)."""
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=pick_mutation(pick)),
                                 dynamic_metadata=destination_metadata(pick.address))


def streamed_body(body: bytes, end_of_stream: bool, request: bool = True) -> pb.ProcessingResponse:
    """Full-duplex mode: ``body`` streamed back as the (request or response) body."""
    common = pb.CommonResponse(body_mutation=pb.BodyMutation(
        streamed_response=pb.StreamedBodyResponse(body=body, end_of_stream=end_of_stream)))
    answer = pb.BodyResponse(response=common)
    return pb.ProcessingResponse(request_body=answer) if request else pb.ProcessingResponse(response_body=answer)


@dataclass(frozen=True)
class Refusal:
    """What the client gets instead of an engine: ``err`` in OpenAI's error format."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes
    details: str  # Envoy's response-code details, for its access log

    @classmethod
    def of(cls, err: APIError) -> Refusal:
        hdrs = [("content-type", "application/json"), *((k.lower(), v) for k, v in (err.headers or {}).items())]
        return cls(err.status, hdrs, msgspec.json.encode(err.body()), f"kvmesh_picker_{err.code or err.status}")


def immediate(err: APIError) -> pb.ProcessingResponse:
    """Answer the client now with ``err``; the request goes nowhere."""
    r = Refusal.of(err)
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=r.status), headers=pb.HeaderMutation(set_headers=_set(r.headers)),
        body=r.body, details=r.details))


def empty(kind: str) -> pb.ProcessingResponse:
    """A pass-through answer to a message of ``kind`` (``request_headers``, ``response_body``, ...)."""
    if kind in ("request_headers", "response_headers"):
        return pb.ProcessingResponse(**{kind: pb.HeadersResponse()})
    if kind in ("request_body", "response_body"):
        return pb.ProcessingResponse(**{kind: pb.BodyResponse()})
    return pb.ProcessingResponse(**{kind: pb.TrailersResponse()})
