"""The compiled ext_proc front as a child of the router: found or built, started, restarted, stopped.

The front (engine/router/front/, Go) carries Envoy's gRPC streams so that the router's event loop
sees one small frame per pick instead of a grpc.aio stream per request (docs/benchmarks.md,
"Gateway"); the router answers it on a Unix socket (engine/router/front_socket.py).

The binary is looked up in ``$KVMESH_CACHE_DIR/extproc-front/<source digest>/`` and built there on
first use when a Go toolchain is on PATH (``go build`` fetches its modules through the Go proxy,
or the module cache when offline); an image ships it prebuilt the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from kvmesh.engine.router.front_socket import FrontSocket
from kvmesh.engine.util.cache_dir import building, default_cache_dir

if TYPE_CHECKING:
    from kvmesh.engine.router.app import RouterApp
    from kvmesh.engine.router.extproc import ExtProcServer

log = logging.getLogger("kvmesh.router.front")

SOURCE = Path(__file__).with_name("front")
BINARY = "kvmesh-extproc-front"
BUILD_TIMEOUT_S = 600
START_TIMEOUT_S = 30
RESTART_DELAY_S = 1.0


class FrontUnavailable(RuntimeError):
    """The compiled front cannot be built or started here; the message says why and what to do."""


def source_digest(source: Path = SOURCE) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in source.iterdir() if p.suffix == ".go" or p.name in ("go.mod", "go.sum")):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def binary_path(cache_dir: Path | None = None) -> Path:
    return (cache_dir or default_cache_dir()) / "extproc-front" / source_digest() / BINARY


def ensure_binary(cache_dir: Path | None = None) -> Path:
    """The front's binary, built on first use; raises ``FrontUnavailable`` when it cannot be."""
    target = binary_path(cache_dir)
    if target.exists():
        return target
    go = shutil.which("go")
    if go is None:
        raise FrontUnavailable(f"no Go toolchain on PATH to build the ext_proc front into {target} (install Go "
                               "1.24 or later, or copy a prebuilt binary there)")
    env = {**os.environ, "GOTOOLCHAIN": "local", "CGO_ENABLED": "0", "GOWORK": "off",
           "GOFLAGS": "-mod=mod -buildvcs=false"}
    log.info("building the ext_proc front (once, into %s)", target.parent)
    with building(target) as out:
        try:
            done = subprocess.run([go, "build", "-trimpath", "-ldflags=-s -w", "-o", str(out), "."], cwd=SOURCE,
                                  env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise FrontUnavailable(f"building the ext_proc front took over {BUILD_TIMEOUT_S} s") from None
        if done.returncode != 0:
            raise FrontUnavailable(f"building the ext_proc front failed: {done.stderr.strip()[-2000:]}")
    return target


async def ext_proc_server(app: RouterApp) -> FrontProcess | ExtProcServer:
    """The ext_proc server ``app.settings.ext_proc_front`` asks for (not started yet)."""
    settings = app.settings
    assert settings.ext_proc_port is not None
    if settings.ext_proc_front != "python":
        try:
            binary = await asyncio.get_running_loop().run_in_executor(None, ensure_binary)
        except FrontUnavailable as e:
            if settings.ext_proc_front == "compiled":
                raise
            log.warning("%s; serving ext_proc from Python instead (0.4-0.5 ms more per request where it was "
                        "measured: docs/benchmarks.md, \"Gateway\")", e)
        else:
            app.metrics.ext_proc.labels("compiled").set(1)
            return FrontProcess(app, settings.ext_proc_host, settings.ext_proc_port, binary)
    from kvmesh.engine.router.extproc import ExtProcServer  # grpc only when serving it

    app.metrics.ext_proc.labels("python").set(1)
    return ExtProcServer(app, settings.ext_proc_host, settings.ext_proc_port)


class FrontProcess:
    """The front serving ``host:port``, asking ``app``; restarted when it exits on its own."""

    def __init__(self, app: RouterApp, host: str, port: int, binary: Path) -> None:
        self.app, self.host, self.port, self.binary = app, host, port, binary
        self._dir = Path(tempfile.mkdtemp(prefix="kvmesh-picker-"))
        self.socket = FrontSocket(app, str(self._dir / "pick.sock"))
        self.proc: asyncio.subprocess.Process | None = None
        self._watch: asyncio.Task | None = None
        self._stopping = False

    async def start(self) -> int:
        """Start the socket and the front; returns the port it serves (the bound one for port 0)."""
        try:
            await self.socket.start()
            self.port = await self._spawn()
        except BaseException:
            await self.stop()
            raise
        self._watch = asyncio.create_task(self._keep_running(), name="ext_proc front watch")
        log.info("ext_proc endpoint picker (compiled front %s) listening on %s:%d", self.binary.name, self.host,
                 self.port)
        return self.port

    async def _spawn(self) -> int:
        listen = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        proc = self.proc = await asyncio.create_subprocess_exec(
            str(self.binary), "--listen", listen, "--pick-socket", self.socket.path,
            "--max-request-bytes", str(self.app.settings.max_request_bytes), "--parent-pid", str(os.getpid()),
            stdout=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL)
        assert proc.stdout is not None
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), START_TIMEOUT_S)
        except TimeoutError:
            line = b""
        words = line.decode(errors="replace").split()
        if len(words) != 2 or words[0] != "listening" or not words[1].isdigit():
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise OSError(f"--ext-proc-port: the ext_proc front could not listen on {listen} (exit status "
                          f"{proc.returncode}; its log is above): the port is in use or the address is not this "
                          "host's; pick another --ext-proc-port (or --host)")
        return int(words[1])

    async def _keep_running(self) -> None:
        while not self._stopping:
            assert self.proc is not None
            code = await self.proc.wait()
            if self._stopping:
                return
            log.error("the ext_proc front exited with status %s; restarting it in %.0f s", code, RESTART_DELAY_S)
            await asyncio.sleep(RESTART_DELAY_S)
            try:
                await self._spawn()
            except OSError as e:
                log.error("%s", e)

    async def stop(self) -> None:
        self._stopping = True
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        proc = self.proc
        if proc is not None and proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 8)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        await self.socket.stop()
        shutil.rmtree(self._dir, ignore_errors=True)
