"""Processes on this machine: free ports, waiting for an HTTP readiness probe, a log's last lines.

Used by `kvmesh up`, the benchmarks and the tests, which all start kvmesh processes on 127.0.0.1
and wait for them. A port returned here is free when asked, not reserved: a caller binds it soon.
"""

from __future__ import annotations

import random
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path


_LOWEST_PORT = 10000


class ProcessExited(RuntimeError):
    """The process being waited for exited before it became ready."""


class NotReady(TimeoutError):
    """The process did not answer its readiness probe in time."""


def _ephemeral_low() -> int:
    """The first port the kernel hands to outbound connections; ports below it are never taken
    behind a test's back by some process's client socket."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int, host: str) -> bool:
    # UCX and some servers listen on the wildcard address, so a port must be free there too.
    for addr in dict.fromkeys((host, "0.0.0.0")):
        with socket.socket() as s:
            try:
                s.bind((addr, port))
            except OSError:
                return False
    return True


def free_port_run(n: int, host: str = "127.0.0.1", avoid: frozenset[int] = frozenset()) -> int:
    """A port P such that P .. P + n - 1 are all free (for a process, or `kvmesh up`, that takes
    consecutive ports from a base), none of them in ``avoid``.

    Ports come from below the kernel's ephemeral range, at random: a port the kernel picks for
    ``bind(0)`` can be taken a moment later by any outbound connection on the machine."""
    high = min(_ephemeral_low(), 65536) - n
    rng = random.SystemRandom()
    for _ in range(500):
        port = rng.randrange(_LOWEST_PORT, high)
        ports = range(port, port + n)
        if not avoid.intersection(ports) and all(_bindable(p, host) for p in ports):
            return port
    raise RuntimeError(f"no {n} consecutive free ports on {host} below {high + n}")


def free_port(host: str = "127.0.0.1") -> int:
    return free_port_run(1, host)


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct free ports."""
    ports: list[int] = []
    while len(ports) < n:
        ports.append(free_port_run(1, host, avoid=frozenset(ports)))
    return ports


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A port P such that P and P + 1 are both free (an HTTP port and the UCX or replay port)."""
    return free_port_run(2, host)


def http_get(url: str, timeout_s: float = 2.0) -> tuple[int, bytes] | None:
    """(status, body) of a GET of ``url``, or None when nothing answers. The standard library's
    client: the local processes' supervisors (``kvmesh up``, the tests) need no other."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read() or b""
    except (OSError, ValueError):
        return None


def http_status(url: str, timeout_s: float = 2.0) -> int | None:
    """The status of a GET of ``url``, or None when nothing answers."""
    got = http_get(url, timeout_s)
    return None if got is None else got[0]


def log_tail(path: Path | None, n: int = 40) -> str:
    if path is None:
        return ""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def wait_ready(url: str, timeout_s: float, proc: subprocess.Popen | None = None, log: Path | None = None,
               interval_s: float = 0.2, what: str = "process") -> None:
    """Poll GET ``url`` until it answers 200. Raises ProcessExited as soon as ``proc`` exits and
    NotReady after ``timeout_s``, both with the last lines of ``log``."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise ProcessExited(f"{what} exited with code {proc.returncode} before {url} answered:\n"
                                f"{log_tail(log)}")
        if http_status(url) == 200:
            return
        if time.monotonic() > deadline:
            raise NotReady(f"{what} not ready at {url} after {timeout_s:.0f}s:\n{log_tail(log)}")
        time.sleep(interval_s)
