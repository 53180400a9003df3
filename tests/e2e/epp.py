"""The Gateway API Inference Extension's endpoint picker (EPP), built from its Go module by
e2e/build-binaries, run as a local process against the test cluster's API server.

It watches one InferencePool and the pods it selects, scrapes each pod's model-server metrics
(`vllm:*` names) and answers Envoy's ext_proc stream with the endpoint to use.
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvmesh.engine.util.localproc import free_ports, log_tail, wait_ready
from kvmesh.engine.util.metrics import parse_samples

from .helpers import ROOT

BUILD = ROOT / "e2e" / "build-binaries"
POOL_API = ("inference.networking.k8s.io", "v1", "inferencepools")


def gie_dir(build: bool = True) -> Path:
    """The cached EPP build directory, holding ``epp`` (built when missing)."""
    if build:
        subprocess.run([str(BUILD), "epp"], check=True)
    out = subprocess.run([str(BUILD), "--print-dirs", "epp"], capture_output=True, text=True, check=True).stdout
    d = Path(out.strip().split("=", 1)[1])
    if not (d / ".complete").exists():
        raise FileNotFoundError(f"no EPP build in {d}; run {BUILD} epp")
    return d


def inference_pool(name: str, selector: dict[str, str], port: int, picker: str, picker_port: int) -> dict:
    """An InferencePool (v1) selecting the model-server pods by ``selector`` on ``port``."""
    group, version, _ = POOL_API
    return {"apiVersion": f"{group}/{version}", "kind": "InferencePool", "metadata": {"name": name},
            "spec": {"selector": {"matchLabels": selector}, "targetPorts": [{"number": port}],
                     "endpointPickerRef": {"name": picker, "port": {"number": picker_port}}}}


@dataclass
class EppProcess:
    proc: subprocess.Popen
    grpc_port: int
    health_port: int
    metrics_port: int
    log_path: Path

    @classmethod
    def start(cls, binary: Path, kubeconfig: Path, namespace: str, pool: str, log_path: Path,
              timeout: float = 120) -> EppProcess:
        grpc, health, metrics = free_ports(3)
        # Metrics without the apiserver's TokenReview (the test scrapes them directly), and gRPC in
        # plaintext: deployed pickers serve TLS (self-signed by default), which the shared gateway
        # config (engine/router/envoy_config.py) does not speak; the ext_proc protocol is the same.
        cmd = [str(binary), "--pool-name", pool, "--pool-namespace", namespace, "--grpc-port", str(grpc),
               "--grpc-health-port", str(health), "--metrics-port", str(metrics), "--secure-serving=false",
               "--metrics-endpoint-auth=false", "--zap-encoder", "console", "--v", "3"]
        env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        self = cls(proc, grpc, health, metrics, log_path)
        try:
            wait_ready(self.metrics_url, timeout, proc, log_path, what="EPP")
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def metrics(self) -> dict:
        return parse_samples(httpx.get(self.metrics_url, timeout=10).text)

    def tail(self, n: int = 60) -> str:
        return log_tail(self.log_path, n)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
