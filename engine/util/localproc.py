"""Processes on this machine: free ports, waiting for an HTTP readiness probe, a log's last lines.

Used by `kvmesh up`, the benchmarks and the tests, which all start kvmesh processes on 127.0.0.1
and wait for them. A port returned here is free when asked, not reserved: a caller binds it soon.
"""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path


class ProcessExited(RuntimeError):
    """The process being waited for exited before it became ready."""


class NotReady(TimeoutError):
    """The process did not answer its readiness probe in time."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct free ports (all bound at once while asking, so they differ)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port_run(n: int, host: str = "127.0.0.1") -> int:
    """A port P such that P .. P + n - 1 are all free (for a process, or `kvmesh up`, that takes
    consecutive ports from a base)."""
    for _ in range(200):
        socks = [socket.socket()]
        try:
            socks[0].bind((host, 0))
            port = socks[0].getsockname()[1]
            if port + n - 1 > 65535:
                continue
            for k in range(1, n):
                s = socket.socket()
                socks.append(s)
                s.bind((host, port + k))
            return port
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports on {host}")


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A port P such that P and P + 1 are both free (an HTTP port and the UCX or replay port)."""
    return free_port_run(2, host)


def http_status(url: str, timeout_s: float = 2.0) -> int | None:
    """The status of a GET of ``url``, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, ValueError):
        return None


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
