"""Who may call which HTTP endpoint: the deployment's internal token and the clients' API keys.

Every kvmesh HTTP server (``kvmesh serve``, ``kvmesh router``, ``kvmesh cache-node``) asks the
same two questions of a request: which access its path needs (``access_for``), and whether the
``Authorization: Bearer`` credential it carries grants that access (``Credentials.check``).

- ``OPEN``: ``/health``, ``/ready``, ``/metrics`` (probes and Prometheus), always.
- ``INTERNAL``: ``/admin/*`` and ``/kv/*``, and an engine's prefill/decode internals: only the
  internal token (``--auth-token-file``) when one is set. A client key is refused here (403),
  so a key handed to an application can never drain an engine or read the cache's contents.
- ``CLIENT``: the OpenAI endpoints: a client key (``--api-key``) or the internal token (the
  router forwards with it) when keys are set; anyone when none are.

Tokens are compared in constant time; a token file is re-read when it changes on disk (a
rotated Kubernetes Secret), never logged, and an empty or unreadable one fails at start.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import APIError

OPEN, CLIENT, INTERNAL = "open", "client", "internal"
_OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})


class AuthConfigError(ValueError):
    """A token or key file is missing, unreadable or empty; the message names it."""


def access_for(path: str) -> str:
    """The access ``path`` needs (one policy for every role's server)."""
    if path in _OPEN_PATHS:
        return OPEN
    if path.startswith(("/admin/", "/kv/")) or path in ("/admin", "/kv"):
        return INTERNAL
    return CLIENT


def bearer(authorization: str | bytes | None) -> str | None:
    """The credential of an ``Authorization: Bearer <credential>`` header, or None."""
    if authorization is None:
        return None
    if isinstance(authorization, bytes):
        authorization = authorization.decode("latin-1")
    scheme, _, value = authorization.strip().partition(" ")
    return (value.strip() or None) if scheme.lower() == "bearer" else None


def _read_secret(path: Path) -> str:
    try:
        text = path.read_text().strip()
    except OSError as e:
        raise AuthConfigError(f"cannot read {path}: {e.strerror or e}") from None
    if not text:
        raise AuthConfigError(f"{path} is empty; write the token into it")
    return text


def _read_keys(path: Path) -> frozenset[str]:
    """Every non-empty, non-comment line of an API key file."""
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise AuthConfigError(f"cannot read the API key file {path}: {e.strerror or e}") from None
    return frozenset(ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#"))


@dataclass
class _WatchedFile:
    """What a file holds, re-read when the file's identity or size changes (a Secret volume swaps
    a symlink on rotation). A file that vanishes, or fails to read, later keeps the last value."""

    path: Path
    _value: Any = field(default=None, repr=False)
    _stamp: tuple[int, int, int] | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def _read(self, path: Path) -> Any:
        raise NotImplementedError

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        self._value = self._read(self.path)  # unreadable at start: an AuthConfigError, before serving
        self._stamp = self._stat()

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _current(self) -> Any:
        stamp = self._stat()
        if stamp is not None and stamp != self._stamp:
            with self._lock:
                try:
                    self._value = self._read(self.path)
                except AuthConfigError:
                    pass  # mid-rotation: keep serving with what we have
                self._stamp = stamp
        return self._value


class TokenFile(_WatchedFile):
    """The internal token in a file (``--auth-token-file``); an empty file is refused at start."""

    def _read(self, path: Path) -> str:
        return _read_secret(path)

    @property
    def token(self) -> str:
        return self._current()


class KeyFile(_WatchedFile):
    """Client keys in a file, one per line (``--api-key-file``); a rotated Secret is re-read."""

    def _read(self, path: Path) -> frozenset[str]:
        return _read_keys(path)

    @property
    def keys(self) -> frozenset[str]:
        return self._current()


def read_api_keys(keys: list[str] | tuple[str, ...] = (), key_files: list[str] | tuple[str, ...] = ()) -> frozenset[str]:
    """``--api-key`` values plus every non-empty, non-comment line of each ``--api-key-file``."""
    out = {k.strip() for k in keys if k.strip()}
    for f in key_files:
        out |= _read_keys(Path(f))
    return frozenset(out)


def unauthorized(message: str) -> APIError:
    return APIError(message, 401, "invalid_request_error", "invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})


def forbidden(message: str) -> APIError:
    return APIError(message, 403, "invalid_request_error", "forbidden")


def tenant_salt(api_key: str, cache_salt: str | None = None) -> str:
    """The cache salt of a request made with ``api_key`` under ``--isolate-tenants``: the key's
    identity (a digest: the key itself never reaches a block hash, a log or an event), then the
    request's own salt, so a tenant can still split its own traffic but never reach another's."""
    ident = hashlib.sha256(b"kvmesh-tenant-v1\0" + api_key.encode()).hexdigest()[:32]
    return f"tenant:{ident}" + (f"/{cache_salt}" if cache_salt else "")


@dataclass
class Credentials:
    """What one server accepts: the internal token (if any) and the client keys (if any).

    ``isolate_tenants``: every request made with a client key gets that key's ``tenant_salt``, so
    tenants (keys) never share cached prefixes. Requests with the internal token keep the salt
    they carry: the router salted them already."""

    token: TokenFile | None = None
    api_keys: frozenset[str] = frozenset()
    """``--api-key`` values (fixed)."""
    isolate_tenants: bool = False
    key_files: tuple[KeyFile, ...] = ()
    """``--api-key-file`` files, re-read when they change."""

    def __post_init__(self) -> None:
        if self.isolate_tenants and not (self.api_keys or self.key_files):
            raise AuthConfigError("--isolate-tenants needs client keys (--api-key or --api-key-file): "
                                  "tenants are told apart by the key they send")

    @classmethod
    def from_options(cls, token_file: str | None = None, api_keys: list[str] | tuple[str, ...] = (),
                     api_key_files: list[str] | tuple[str, ...] = (), isolate_tenants: bool = False) -> Credentials:
        return cls(TokenFile(Path(token_file)) if token_file else None, read_api_keys(api_keys),
                   isolate_tenants, tuple(KeyFile(Path(f)) for f in api_key_files))

    def client_keys(self) -> frozenset[str]:
        """Every key a client may send now."""
        if not self.key_files:
            return self.api_keys
        return self.api_keys.union(*(f.keys for f in self.key_files))

    def cache_salt(self, authorization: str | bytes | None, cache_salt: str | None) -> str | None:
        """The salt a request with this ``Authorization`` and body ``cache_salt`` runs under."""
        if not self.isolate_tenants:
            return cache_salt
        cred = bearer(authorization)
        if cred is None or not self.is_client(cred) or self.is_internal(cred):
            return cache_salt
        return tenant_salt(cred, cache_salt)

    @property
    def enabled(self) -> bool:
        return self.token is not None or bool(self.api_keys) or bool(self.key_files)

    def internal_token(self) -> str | None:
        return self.token.token if self.token is not None else None

    def is_internal(self, credential: str | None) -> bool:
        t = self.internal_token()
        return t is not None and credential is not None and hmac.compare_digest(credential.encode(), t.encode())

    def is_client(self, credential: str | None) -> bool:
        if credential is None:
            return False
        c = credential.encode()
        # Every key is compared, so the time taken says nothing about which one matched.
        return bool(sum(hmac.compare_digest(c, k.encode()) for k in self.client_keys()))

    def check(self, access: str, authorization: str | bytes | None) -> APIError | None:
        """None when a request carrying ``authorization`` may have ``access``; else the error."""
        if access == OPEN:
            return None
        cred = bearer(authorization)
        if access == INTERNAL:
            if self.token is None or self.is_internal(cred):
                return None
            if cred is None:
                return unauthorized("this endpoint needs the deployment's internal token "
                                    "(Authorization: Bearer, the --auth-token-file of this server)")
            if self.is_client(cred):
                return forbidden("an API key does not grant access to internal or admin endpoints")
            return unauthorized("the internal token is not valid")
        if not (self.api_keys or self.key_files) or self.is_client(cred) or self.is_internal(cred):
            return None
        if cred is None:
            return unauthorized("this server needs an API key: send Authorization: Bearer <key>")
        return unauthorized("the API key is not valid")


class AuthGate:
    """ASGI middleware: answers a request its credential does not allow with the OpenAI-shaped
    401/403 (before the app reads a byte of the body); everything else goes to ``app``.
    ``on_refused(access, status)`` counts refusals (a metrics hook)."""

    def __init__(self, app: Callable[..., Awaitable[None]], credentials: Credentials,
                 on_refused: Callable[[str, int], None] = lambda access, status: None) -> None:
        self.app = app
        self.credentials = credentials
        self.on_refused = on_refused

    def __getattr__(self, name: str) -> Any:  # e.g. FastAPI's app.state, seen through the wrapper
        return getattr(self.app, name)

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[Any]],
                       send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        if scope["type"] == "http" and self.credentials.enabled:
            access = access_for(scope["path"])
            auth = next((v for k, v in scope.get("headers", ()) if k.lower() == b"authorization"), None)
            err = self.credentials.check(access, auth)
            if err is not None:
                self.on_refused(access, err.status)
                body = json.dumps(err.body()).encode()
                headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
                headers += [(k.lower().encode(), v.encode()) for k, v in (err.headers or {}).items()]
                await send({"type": "http.response.start", "status": err.status, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


SECURITY = "security"


def add_auth_arguments(parser: argparse.ArgumentParser, client_keys: bool = True) -> None:
    """``--auth-token-file`` (every role) and, for the servers clients call, ``--api-key`` and
    ``--api-key-file``: one definition for ``kvmesh serve``, ``router`` and ``cache-node``."""
    g = parser.add_argument_group(SECURITY)
    g.add_argument("--auth-token-file", default=None, metavar="PATH",
                   help="the deployment's internal token: admin and internal endpoints (/admin/*, /kv/*, the "
                        "prefill/decode internals) need 'Authorization: Bearer <token>'; /health, /ready and "
                        "/metrics stay open. Re-read when the file changes (default: none, no check)")
    if client_keys:
        g.add_argument("--api-key", action="append", default=None, metavar="KEY",
                       help="a key clients must send as 'Authorization: Bearer <key>' to the OpenAI endpoints "
                            "(repeatable; prefer --api-key-file, a command line is visible to other users)")
        g.add_argument("--api-key-file", action="append", default=None, metavar="PATH",
                       help="a file of API keys, one per line (repeatable)")
        g.add_argument("--isolate-tenants", action="store_true",
                       help="give every API key its own prefix cache: requests share cached KV only with "
                            "requests of the same key (and the same cache_salt, if they send one)")


def credentials_from_args(args: argparse.Namespace) -> Credentials:
    """The ``Credentials`` the auth options ask for; ``AuthConfigError`` names an unusable file."""
    return Credentials.from_options(getattr(args, "auth_token_file", None), getattr(args, "api_key", None) or (),
                                    getattr(args, "api_key_file", None) or (),
                                    getattr(args, "isolate_tenants", False))
