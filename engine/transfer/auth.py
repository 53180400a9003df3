"""Mutual proof of the deployment's internal token on a KV transport connection.

The token never travels: each side proves it holds it with an HMAC-SHA256 over both sides'
fresh nonces and a label naming the direction (so a proof cannot be replayed, reflected, or
reused on another connection)::

    client -> Hello(nonce=Nc)
    server -> Hello(nonce=Ns, proof=HMAC(token, "kvmesh-kv-server" | Nc | Ns))
    client -> Auth(proof=HMAC(token, "kvmesh-kv-client" | Ns | Nc))
    server -> AuthOk                    (or ErrorReply(unauthorized), and the connection closes)

A server without a token sends no nonce and accepts anyone; a client that holds a token refuses
such a server (no downgrade: an impostor cannot simply skip the proof), and a client without one
refuses a server that asks for it, each with a message naming ``--auth-token-file``.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Callable

NONCE_BYTES = 32
SERVER, CLIENT = b"kvmesh-kv-server", b"kvmesh-kv-client"

TokenSource = Callable[[], "str | None"]
"""Gives the current internal token (a rotated file is re-read), or None: no authentication."""


def no_token() -> None:
    return None


def nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def proof(token: str, label: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(token.encode(), label + first + second, hashlib.sha256).digest()


def valid(token: str, label: bytes, first: bytes, second: bytes, got: bytes) -> bool:
    return len(first) == len(second) == NONCE_BYTES and hmac.compare_digest(proof(token, label, first, second), got)
