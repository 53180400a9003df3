"""Cluster DNS for the real node's pods: `<service>.<namespace>.svc.cluster.local`.

A small stand-in for CoreDNS (building CoreDNS would add its own dependency
tree to the cold build for one plugin's worth of behaviour). It answers A
queries from the API server's Services and EndpointSlices, polled every
second, on UDP at the node's bridge address (the pods' gateway):

- a Service name resolves to the addresses of its ready endpoints. For a
  headless Service that is Kubernetes' own behaviour; for a ClusterIP Service
  it stands in for the virtual IP, since this cluster runs no kube-proxy
  (which would install NAT rules in the machine's shared network namespace);
- any other name in cluster.local is NXDOMAIN, and so are names outside it:
  pods here have no route beyond the node.

Packet handling (`answer`) and the name table (`records`) are pure functions.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from typing import Any, Iterable, Mapping

from .api import Api, ApiError

DOMAIN = "cluster.local"
TTL_S = 2
QTYPE_A = 1
NOERROR, FORMERR, NXDOMAIN, NOTIMP = 0, 1, 3, 4


class DnsFormatError(ValueError):
    """A packet that is not a well-formed single-question query."""


def records(services: Iterable[Mapping[str, Any]], slices: Iterable[Mapping[str, Any]],
            domain: str = DOMAIN) -> dict[str, list[str]]:
    """FQDN (lower case, no trailing dot) -> sorted IPv4 addresses of ready endpoints."""
    ready: dict[tuple[str, str], set[str]] = {}
    for sl in slices:
        meta = sl.get("metadata") or {}
        svc = (meta.get("labels") or {}).get("kubernetes.io/service-name")
        if not svc or sl.get("addressType") != "IPv4":
            continue
        addrs = ready.setdefault((meta.get("namespace", ""), svc), set())
        for ep in sl.get("endpoints") or ():
            if (ep.get("conditions") or {}).get("ready") is not False:
                addrs.update(ep.get("addresses") or ())
    out = {}
    for svc in services:
        meta = svc.get("metadata") or {}
        key = (meta.get("namespace", ""), meta.get("name", ""))
        out[f"{key[1]}.{key[0]}.svc.{domain}".lower()] = sorted(ready.get(key, ()))
    return out


def parse_query(packet: bytes) -> tuple[int, int, str, int, int]:
    """(id, flags, qname, qtype, end of question) of a one-question query."""
    if len(packet) < 12:
        raise DnsFormatError("shorter than a DNS header")
    qid, flags, qdcount = struct.unpack_from("!HHH", packet)
    if flags & 0x8000 or qdcount != 1:
        raise DnsFormatError("not a single-question query")
    labels, pos = [], 12
    while True:
        if pos >= len(packet):
            raise DnsFormatError("question runs past the packet")
        n = packet[pos]
        pos += 1
        if n == 0:
            break
        if n & 0xC0 or pos + n > len(packet):
            raise DnsFormatError("bad label")
        labels.append(packet[pos:pos + n].decode("ascii", "replace"))
        pos += n
    if pos + 4 > len(packet):
        raise DnsFormatError("question has no type and class")
    qtype, _qclass = struct.unpack_from("!HH", packet, pos)
    return qid, flags, ".".join(labels).lower(), qtype, pos + 4


def answer(packet: bytes, table: Mapping[str, list[str]]) -> bytes:
    """The response to one query packet (FORMERR for what cannot be parsed)."""
    try:
        qid, flags, qname, qtype, end = parse_query(packet)
    except DnsFormatError:
        qid = struct.unpack_from("!H", packet)[0] if len(packet) >= 2 else 0
        return struct.pack("!HHHHHH", qid, 0x8000 | FORMERR, 0, 0, 0, 0)
    opcode = flags & 0x7800
    if opcode:
        rcode, ips = NOTIMP, []
    elif qname in table:
        rcode, ips = NOERROR, (table[qname] if qtype == QTYPE_A else [])
    else:
        rcode, ips = NXDOMAIN, []
    # QR, the query's opcode and RD, authoritative, recursion "available".
    out_flags = 0x8000 | opcode | 0x0400 | (flags & 0x0100) | 0x0080 | rcode
    out = bytearray(struct.pack("!HHHHHH", qid, out_flags, 1, len(ips), 0, 0))
    out += packet[12:end]
    for ip in ips:
        out += struct.pack("!HHHIH", 0xC00C, QTYPE_A, 1, TTL_S, 4) + socket.inet_aton(ip)
    return bytes(out)


class Table:
    """The current name table, refreshed from the API server on a thread."""

    def __init__(self, api: Api, every_s: float = 1.0) -> None:
        self.api, self.every_s = api, every_s
        self.current: dict[str, list[str]] = {}
        threading.Thread(target=self._loop, daemon=True, name="dns-refresh").start()

    def refresh(self) -> None:
        services = self.api.get("/api/v1/services").get("items", [])
        slices = self.api.get("/apis/discovery.k8s.io/v1/endpointslices").get("items", [])
        self.current = records(services, slices)

    def _loop(self) -> None:
        while True:
            try:
                self.refresh()
            except (ApiError, OSError, ValueError, AttributeError):
                pass  # the API server may be starting or stopping; keep the last table
            time.sleep(self.every_s)


def serve(api: Api, address: str, port: int = 53) -> None:
    """Answer queries on UDP address:port until killed."""
    table = Table(api)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((address, port))
    print(f"cluster DNS on {address}:{port}/udp for *.svc.{DOMAIN}", flush=True)
    while True:
        packet, peer = sock.recvfrom(4096)
        sock.sendto(answer(packet, table.current), peer)
