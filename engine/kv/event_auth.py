"""CURVE keys for the KV event sockets, derived from the deployment's internal token.

An engine's KV events name every block it caches (and, in vLLM's layout, the token ids), so with
a token set the PUB and replay sockets are CURVE servers: only a peer that knows the server's
public key completes the handshake, and a ZAP handler admits only the client key. Both key pairs
are derived from the token (SHA-256 of a label and the token as the CURVE secret), so whoever
holds the token (the router, a cache node's subscriber) can subscribe and nobody else receives a
byte. The keys are fixed when the publisher binds: a rotated token takes effect for KV events at
the engine's next start (docs/security.md).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import zmq
import zmq.auth.thread

_SERVER, _CLIENT = b"kvmesh-kv-events-server:", b"kvmesh-kv-events-client:"


@dataclass(frozen=True)
class CurveKeys:
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def _pair(label: bytes, token: str) -> tuple[bytes, bytes]:
    secret = zmq.utils.z85.encode(hashlib.sha256(label + token.encode()).digest())
    return zmq.curve_public(secret), secret


def curve_keys(token: str) -> CurveKeys:
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq has no CURVE support; KV events cannot be authenticated")
    sp, ss = _pair(_SERVER, token)
    cp, cs = _pair(_CLIENT, token)
    return CurveKeys(sp, ss, cp, cs)


def secure_server(ctx: zmq.Context, sockets: list[zmq.Socket], keys: CurveKeys) -> zmq.auth.thread.ThreadAuthenticator:
    """Make ``sockets`` CURVE servers admitting only ``keys.client_public``; returns the ZAP
    authenticator to stop with the context."""
    auth = zmq.auth.thread.ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=_AllowOne(keys.client_public))
    for s in sockets:
        s.curve_server = True
        s.curve_secretkey = keys.server_secret
        s.curve_publickey = keys.server_public
    return auth


def secure_client(sock: zmq.Socket, keys: CurveKeys) -> None:
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret


class _AllowOne:
    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:  # pyzmq passes the client key z85-encoded
        return key == self.public
