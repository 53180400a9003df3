"""The operator's calls to its pods: an engine's drain endpoint (POST/GET/DELETE /admin/drain,
with the deployment's internal token) and a router's readiness report (GET /ready, open)."""

from __future__ import annotations

import httpx

TIMEOUT_S = 5.0


class DrainRequestError(RuntimeError):
    """An engine refused or did not answer a drain request; the message names it."""


def _auth(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _admin_drain(method: str, endpoint: str, token: str | None, params: dict | None = None) -> None:
    url = f"http://{endpoint}/admin/drain"
    try:
        r = httpx.request(method, url, params=params, headers=_auth(token), timeout=TIMEOUT_S)
    except httpx.HTTPError as exc:
        raise DrainRequestError(f"{method} {url}: {exc}") from exc
    if r.status_code not in (200, 202):
        raise DrainRequestError(f"{method} {url}: HTTP {r.status_code}: {r.text[:200]}")


def start_drain(endpoint: str, lease_s: float, token: str | None = None) -> None:
    """Drain the engine, or renew its drain: it serves again unless asked within ``lease_s``."""
    _admin_drain("POST", endpoint, token, {"lease_s": lease_s})


def cancel_drain(endpoint: str, token: str | None = None) -> None:
    """Make a draining engine serve again (the pool was scaled up while it drained)."""
    _admin_drain("DELETE", endpoint, token)


def _drain_status(endpoint: str, token: str | None) -> dict | None:
    try:
        r = httpx.get(f"http://{endpoint}/admin/drain", headers=_auth(token), timeout=TIMEOUT_S)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def in_flight(endpoint: str, token: str | None = None) -> int | None:
    """API requests still running on the engine; None when it does not answer (gone)."""
    try:
        return int(_drain_status(endpoint, token)["in_flight"])  # type: ignore[index]
    except (TypeError, KeyError, ValueError):
        return None


def is_draining(endpoint: str, token: str | None = None) -> bool | None:
    """Whether the engine drains now; None when it does not answer."""
    got = _drain_status(endpoint, token)
    return None if got is None else bool(got.get("draining"))


def ready_report(endpoint: str) -> dict | None:
    """The JSON body of GET /ready (answered with 200 or 503); None when nothing usable answers."""
    try:
        r = httpx.get(f"http://{endpoint}/ready", timeout=TIMEOUT_S)
        body = r.json()
        return body if isinstance(body, dict) else None
    except (httpx.HTTPError, ValueError):
        return None
