"""Static Envoy configs that put kvmesh's picker (``kvmesh router --ext-proc-port``) in front of
engines, wired as the Gateway API Inference Extension's reference gateway wires an endpoint picker.

Pure functions returning the config as a dict (``yaml.safe_dump`` it for ``envoy -c``); the tests,
bench/gateway.py and docs/gateway.md all use these, so what is tested is what is documented.

The gateway: an ``envoy.filters.http.ext_proc`` filter calling the picker over gRPC (HTTP/2
cluster), then a route that sends a request carrying ``x-gateway-destination-endpoint`` to an
``ORIGINAL_DST`` cluster that connects to the ``IP:PORT`` in that header. Every response carries
``x-gateway-destination-endpoint-served`` (the upstream Envoy actually used), which the picker reads
to move its load accounting when Envoy connected elsewhere. Body modes:

- ``FULL_DUPLEX_STREAMED`` (the reference gateway's): request and response bodies stream through
  the picker, request trailers sent; the picker answers the headers once the body is whole;
- ``BUFFERED``: Envoy buffers the request body and sends it whole; responses stream (``STREAMED``).

Fail-closed by default: with the picker down Envoy answers 500 at once. ``failure_mode_allow``
lets requests through without a pick; they then need ``fallback`` endpoints (a route for requests
without the destination header), else the ORIGINAL_DST cluster has nowhere to send them. It takes
``BUFFERED`` mode: in ``FULL_DUPLEX_STREAMED`` Envoy 1.40 answers 500 when the picker fails after
the body started streaming to it (the body is then the picker's), whatever ``failure_mode_allow``
says, so a full-duplex gateway fails open only when the failure comes first (seen in
tests/router/test_extproc_envoy.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvmesh.engine.api.body_limit import DEFAULT_MAX_REQUEST_BYTES
from kvmesh.engine.router.epp import DESTINATION, SERVED, SUBSET_NAMESPACE

BODY_MODES = ("FULL_DUPLEX_STREAMED", "BUFFERED")
PICKED_CLUSTER = "kvmesh_picked"
PICKER_CLUSTER = "kvmesh_picker"
FALLBACK_CLUSTER = "kvmesh_fallback"
DIRECT_CLUSTER = "kvmesh_engine"
_HEADROOM = 64 << 10  # request headers and framing on top of the body
_EXT_PROC = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_ROUTER = {"name": "envoy.filters.http.router",
           "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}


def _split(hostport: str) -> tuple[str, int]:
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{hostport!r}: expected HOST:PORT, e.g. 127.0.0.1:8001")
    return host.strip("[]"), int(port)


def _address(hostport: str) -> dict[str, Any]:
    host, port = _split(hostport)
    return {"socket_address": {"address": host, "port_value": port}}


def _static_cluster(name: str, endpoints: Sequence[str], http2: bool = False) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "name": name, "type": "STATIC", "connect_timeout": "1s", "lb_policy": "ROUND_ROBIN",
        "load_assignment": {"cluster_name": name, "endpoints": [
            {"lb_endpoints": [{"endpoint": {"address": _address(e)}} for e in endpoints]}]}}
    if http2:
        cluster["typed_extension_protocol_options"] = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}}}}
    return cluster


def _listener(listen: str, routes: list[dict[str, Any]], http_filters: list[dict[str, Any]],
              response_headers: list[dict[str, Any]] | None = None, buffer_limit: int | None = None) -> dict[str, Any]:
    vhost: dict[str, Any] = {"name": "all", "domains": ["*"], "routes": routes}
    if response_headers:
        vhost["response_headers_to_add"] = response_headers
    listener: dict[str, Any] = {"name": "gateway", "address": _address(listen), "filter_chains": [{"filters": [{
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {"@type": _HCM, "stat_prefix": "gateway", "route_config": {"name": "gateway",
                         "virtual_hosts": [vhost]}, "http_filters": http_filters}}]}]}
    if buffer_limit is not None:
        listener["per_connection_buffer_limit_bytes"] = buffer_limit
    return listener


def _route(cluster: str, header_present: str | None = None) -> dict[str, Any]:
    match: dict[str, Any] = {"prefix": "/"}
    if header_present:
        match["headers"] = [{"name": header_present, "present_match": True}]
    # timeout 0: a generation may stream for minutes; the engines bound their own work.
    return {"match": match, "route": {"cluster": cluster, "timeout": "0s"}}


def _observer_filter() -> dict[str, Any]:
    """The second ext_proc filter: Envoy copies it the request headers (they carry the pick's id)
    and the response without waiting for answers, so following the response costs the request no
    round trip. It never fails a request (``failure_mode_allow``); a stream it leaves open is closed
    ``deferred_close_timeout`` after the request ends, which is when an abandoned request's engine
    is released at the latest."""
    return {"name": "kvmesh.response_observer", "typed_config": {
        "@type": _EXT_PROC, "grpc_service": {"envoy_grpc": {"cluster_name": PICKER_CLUSTER}},
        "observability_mode": True, "failure_mode_allow": True, "deferred_close_timeout": "1s",
        "processing_mode": {"request_header_mode": "SEND", "request_body_mode": "NONE",
                            "request_trailer_mode": "SKIP", "response_header_mode": "SEND",
                            "response_body_mode": "STREAMED", "response_trailer_mode": "SKIP"}}}


def _observing_router() -> dict[str, Any]:
    """The router filter with the observer as an *upstream* filter: it sees only requests that went
    to an engine (an immediate answer from the picker never reaches it) and each upstream attempt."""
    return {"name": "envoy.filters.http.router", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router",
        "upstream_http_filters": [_observer_filter(), {
            "name": "envoy.filters.http.upstream_codec", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.upstream_codec.v3.UpstreamCodec"}}]}}


def duplex_mode(body_mode: str) -> bool:
    return body_mode == "FULL_DUPLEX_STREAMED"


def gateway_config(listen: str, picker: str, body_mode: str = "FULL_DUPLEX_STREAMED", *,
                   failure_mode_allow: bool = False, fallback: Sequence[str] = (),
                   message_timeout_s: float = 10.0, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                   admin: str | None = None, observer: bool = True,
                   response_body: bool = True) -> dict[str, Any]:
    """Envoy listening on ``listen`` (HOST:PORT), asking the picker at ``picker`` (HOST:PORT) where
    each request goes. ``message_timeout_s`` bounds each picker answer (the pick of a long prompt
    waits for its tokenization; Envoy's default of 200 ms is too short for megabyte prompts).
    ``max_request_bytes``: the router's ``--max-request-bytes``; the listener buffers that much (plus
    headers), so a BUFFERED body the picker accepts is not refused first by Envoy's 1 MiB default,
    and a larger one gets the picker's 413 in OpenAI's format.
    ``observer``: follow responses with a second ext_proc filter in observability mode, off the
    request's path (engine/router/extproc_observe.py); False: one filter reads the response too, as
    GIE's reference gateway does (two or three more waits on the picker per request).
    ``response_body``: False, that one filter reads the response headers only (response body NONE,
    trailers SKIP; a common GIE wiring): the engine's load is then released when the headers pass."""
    if body_mode not in BODY_MODES:
        raise ValueError(f"body_mode {body_mode!r}: use one of {', '.join(BODY_MODES)}")
    if failure_mode_allow and duplex_mode(body_mode):
        raise ValueError("failure_mode_allow needs request_body_mode BUFFERED: in FULL_DUPLEX_STREAMED Envoy 1.40 "
                         "answers 500 whenever the picker fails after the body started streaming to it, "
                         "failure_mode_allow or not, so such a gateway would fail open only by chance")
    if failure_mode_allow and not fallback:
        raise ValueError("failure_mode_allow needs fallback endpoints: a request the picker did not route "
                         "carries no destination header, and the ORIGINAL_DST cluster has nowhere to send it")
    duplex = duplex_mode(body_mode)
    mode = {"request_header_mode": "SEND", "response_header_mode": "SEND", "request_body_mode": body_mode,
            "response_body_mode": "FULL_DUPLEX_STREAMED" if duplex else "STREAMED",
            "request_trailer_mode": "SEND" if duplex else "SKIP",
            "response_trailer_mode": "SEND" if duplex else "SKIP"}
    if observer:
        mode.update(response_header_mode="SKIP", response_body_mode="NONE", response_trailer_mode="SKIP")
    elif not response_body:
        mode.update(response_body_mode="NONE", response_trailer_mode="SKIP")
    ext_proc = {"name": "envoy.filters.http.ext_proc", "typed_config": {
        "@type": _EXT_PROC, "grpc_service": {"envoy_grpc": {"cluster_name": PICKER_CLUSTER}},
        "failure_mode_allow": failure_mode_allow, "message_timeout": f"{message_timeout_s:g}s",
        "processing_mode": mode,
        "metadata_options": {"forwarding_namespaces": {"untyped": [SUBSET_NAMESPACE]}}}}
    filters = [ext_proc, _observing_router()] if observer else [ext_proc, _ROUTER]
    routes = [_route(PICKED_CLUSTER, DESTINATION)] + ([_route(FALLBACK_CLUSTER)] if fallback else [])
    served = [{"header": {"key": SERVED, "value": "%UPSTREAM_REMOTE_ADDRESS%"}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]
    clusters = [_static_cluster(PICKER_CLUSTER, [picker], http2=True), {
        "name": PICKED_CLUSTER, "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED", "connect_timeout": "2s",
        "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION}}]
    if fallback:
        clusters.append(_static_cluster(FALLBACK_CLUSTER, fallback))
    config: dict[str, Any] = {"static_resources": {
        "listeners": [_listener(listen, routes, filters, served, max_request_bytes + _HEADROOM)],
        "clusters": clusters}}
    if admin:
        config["admin"] = {"address": _address(admin)}
    return config


def direct_config(listen: str, engine: str, admin: str | None = None) -> dict[str, Any]:
    """Envoy listening on ``listen`` straight to one engine (HOST:PORT): the baseline that the
    picker's added latency is measured against."""
    return round_robin_config(listen, [engine], admin)


def round_robin_config(listen: str, engines: Sequence[str], admin: str | None = None) -> dict[str, Any]:
    """Envoy listening on ``listen`` in front of ``engines`` (HOST:PORT each), round-robin: the
    plain load balancer that other serving stacks run behind (benchmarks compare against it)."""
    config: dict[str, Any] = {"static_resources": {
        "listeners": [_listener(listen, [_route(DIRECT_CLUSTER)], [_ROUTER])],
        "clusters": [_static_cluster(DIRECT_CLUSTER, list(engines))]}}
    if admin:
        config["admin"] = {"address": _address(admin)}
    return config


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvmesh.engine.router.envoy_config LISTEN PICKER [--body-mode M]``: print the gateway config."""
    import argparse

    import yaml

    ap = argparse.ArgumentParser(description="Print a static Envoy config that asks kvmesh's picker where each "
                                             "request goes (docs/gateway.md).")
    ap.add_argument("listen", help="HOST:PORT Envoy listens on, e.g. 0.0.0.0:8080")
    ap.add_argument("picker", help="HOST:PORT of `kvmesh router --ext-proc-port`, e.g. 10.0.0.5:9002")
    ap.add_argument("--body-mode", choices=BODY_MODES, default=BODY_MODES[0])
    ap.add_argument("--failure-mode-allow", action="store_true", help="fail open (BUFFERED only; needs --fallback)")
    ap.add_argument("--fallback", default="", metavar="HOST:PORT,...", help="where requests without a pick go")
    ap.add_argument("--no-observer", action="store_true",
                    help="one ext_proc filter reads the response too (GIE's reference wiring; slower)")
    ap.add_argument("--no-response-body", action="store_true",
                    help="with --no-observer: that filter reads the response headers only")
    args = ap.parse_args(argv)
    fallback = [f for f in args.fallback.split(",") if f]
    try:
        config = gateway_config(args.listen, args.picker, args.body_mode, failure_mode_allow=args.failure_mode_allow,
                                fallback=fallback, observer=not args.no_observer,
                                response_body=not args.no_response_body)
    except ValueError as e:
        ap.error(str(e))
    print(yaml.safe_dump(config, sort_keys=False), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
