"""A real Prometheus (the Debian package's binary) on 127.0.0.1 for the tests.

It scrapes the given targets every second with the labels the test gives each
one (e.g. the `namespace`/`pod` labels Kubernetes discovery would attach), and
keeps its data in a temporary directory it deletes on stop.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from kvmesh.engine.util.localproc import free_port, wait_ready


class PrometheusUnavailable(RuntimeError):
    """No prometheus binary; the message says how to install it."""


def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        raise PrometheusUnavailable(
            "no `prometheus` on PATH: install the Debian package (`apt-get install -y prometheus`, "
            "as scripts/setup does when it runs as root)")
    return path


@dataclass
class PrometheusProcess:
    """Prometheus scraping `targets` ({"host:port": {label: value}}) every `interval_s`."""

    targets: dict[str, dict[str, str]]
    interval_s: int = 1
    port: int = field(default_factory=free_port)
    dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvmesh-prom-")))
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def config(self) -> dict:
        return {
            "global": {"scrape_interval": f"{self.interval_s}s",
                       "evaluation_interval": f"{self.interval_s}s"},
            "scrape_configs": [{
                "job_name": "kvmesh",
                "static_configs": [{"targets": [t], "labels": labels}
                                   for t, labels in self.targets.items()],
            }],
        }

    def start(self, timeout_s: float = 60.0) -> "PrometheusProcess":
        binary = prometheus_binary()
        cfg = self.dir / "prometheus.yml"
        cfg.write_text(yaml.safe_dump(self.config()))
        self._log = open(self.dir / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={cfg}", f"--storage.tsdb.path={self.dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h"],
            stdout=self._log, stderr=subprocess.STDOUT, cwd=self.dir)
        wait_ready(self.url + "/-/ready", timeout_s, self.proc, self.dir / "prometheus.log", what="prometheus")
        return self

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join((self.dir / "prometheus.log").read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def targets_up(self) -> int:
        body = httpx.get(self.url + "/api/v1/query", params={"query": "sum(up)"}, timeout=5).json()
        result = body["data"]["result"]
        return int(float(result[0]["value"][1])) if result else 0

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        log = getattr(self, "_log", None)
        if log is not None:
            log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
