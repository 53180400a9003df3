"""Real kvmesh processes on 127.0.0.1 for the integration tests: `kvmesh serve`, `kvmesh router`
and `kvmesh cache-node`, each on free ports, waited for on its readiness probe, logging where
a failing test can show it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import httpx

from kvmesh.engine.util.localproc import ProcessExited, free_port, free_port_run, free_ports, log_tail, wait_ready
from kvmesh.engine.util.metrics import parse_samples, sample_value

READY_TIMEOUT_S = float(os.environ.get("KVMESH_TEST_READY_TIMEOUT", "600"))
KVMESH = str(Path(sys.executable).with_name("kvmesh"))


class ServerProcess:
    """`python -m kvmesh.engine.server` with the given flags, logging to a file."""

    def __init__(self, *flags: str, host: str = "127.0.0.1", port: int | None = None) -> None:
        """``host``: another loopback address (127.0.0.2, ...) lets several servers share a port,
        as pods with their own addresses do."""
        self.host = host
        self.port = port or free_port()
        self.base_url = f"http://{host}:{self.port}"
        self.dir = Path(tempfile.mkdtemp(prefix="kvmesh-serve-"))
        self.log_path = self.dir / "server.log"
        self.flags = list(flags)
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ServerProcess":
        cmd = [sys.executable, "-m", "kvmesh.engine.server", "--host", self.host, "--port", str(self.port),
               *self.flags]
        self.dir.mkdir(parents=True, exist_ok=True)  # again after a stop
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
        """Close the log and remove the process's directory (a test reads the tail before stopping)."""
        log = getattr(self, "_log", None)
        if log is not None and not log.closed:
            log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class RouterProcess(ServerProcess):
    """`python -m kvmesh router ...`, logging to a file."""

    def start(self) -> RouterProcess:
        cmd = [sys.executable, "-m", "kvmesh", "router", "--host", "127.0.0.1", "--port", str(self.port),
               *self.flags]
        self.dir.mkdir(parents=True, exist_ok=True)  # again after a stop
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=self.dir, stdout=self._log, stderr=subprocess.STDOUT)
        self.wait_ready()
        return self


class NodeProc:
    """`kvmesh cache-node` with its HTTP, UCX and (optionally) KV event ports."""

    def __init__(self, memory: str = "64MiB", events: bool = True, flags: tuple[str, ...] = ()) -> None:
        self.flags = flags
        self.http_port, self.ucx_port = free_ports(2)
        self.events_port = free_port_run(2, avoid=frozenset((self.http_port, self.ucx_port))) if events else 0
        self.memory = memory
        self.proc: subprocess.Popen | None = None

    def start(self) -> NodeProc:
        cmd = [KVMESH, "cache-node", "--memory", self.memory, "--host", "127.0.0.1", "--port", str(self.http_port),
               "--ucx-port", str(self.ucx_port), "--node-id", "node-t", "--kv-events-port", str(self.events_port),
               "--log-level", "warning", *self.flags]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     env=dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n"))
        try:
            wait_ready(f"http://127.0.0.1:{self.http_port}/ready", 60, self.proc, what="cache node")
        except ProcessExited as e:
            raise ProcessExited(f"{e}{self.proc.stderr.read().decode()[-2000:]}") from None
        return self

    def http(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}{path}", timeout=5) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(5)
