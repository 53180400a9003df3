"""A real `kvmesh serve` subprocess on 127.0.0.1 for the integration tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from kvmesh.engine.util.localproc import free_port, free_port_pair, log_tail, wait_ready  # noqa: F401
from kvmesh.engine.util.metrics import parse_samples, sample_value

READY_TIMEOUT_S = float(os.environ.get("KVMESH_TEST_READY_TIMEOUT", "600"))


class ServerProcess:
    """`python -m kvmesh.engine.server` with the given flags, logging to a file."""

    def __init__(self, *flags: str) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.dir = Path(tempfile.mkdtemp(prefix="kvmesh-serve-"))
        self.log_path = self.dir / "server.log"
        self.flags = list(flags)
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ServerProcess":
        cmd = [sys.executable, "-m", "kvmesh.engine.server", "--host", "127.0.0.1", "--port", str(self.port),
               *self.flags]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        self.wait_ready()
        return self

    def log_tail(self, n: int = 40) -> str:
        return log_tail(self.log_path, n)

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        wait_ready(self.base_url + "/ready", timeout, self.proc, self.log_path, what="server")

    def url(self, path: str) -> str:
        return self.base_url + path

    def metrics(self) -> dict:
        r = httpx.get(self.url("/metrics"), timeout=10)
        r.raise_for_status()
        return parse_samples(r.text)

    def metric(self, name: str, **labels: str) -> float | None:
        return sample_value(self.metrics(), name, **labels)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self._close_log()
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._close_log()

    def _close_log(self) -> None:
        log = getattr(self, "_log", None)
        if log is not None and not log.closed:
            log.close()
