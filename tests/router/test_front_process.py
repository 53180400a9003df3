"""The compiled ext_proc front's side of its socket, seen by a router that only listens.

Real: the Go front (built by ``front_proc.ensure_binary``, skipped without Go), its gRPC server, and
Envoy's ext_proc messages from a real gRPC client. Fake: the router (a Unix socket server in this
test that records the frames and answers only what a test tells it to) and Envoy (the gRPC client
sends what Envoy would). The real router meets the real front in test_extproc_envoy.py.
"""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
from pathlib import Path

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from kvmesh.engine.router import epp
from kvmesh.engine.router.front_proc import FrontUnavailable, ensure_binary
from tests.support.extproc_messages import POST, body_msg, chat_body, headers_msg


@pytest.fixture(scope="module")
def binary() -> Path:
    try:
        return ensure_binary()
    except FrontUnavailable as e:
        pytest.skip(str(e))


class ListeningRouter:
    """Accepts the front's connection and records every frame it sends."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.frames: list[dict] = []
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(str(path))
        self.sock.listen(1)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        buf = b""
        while chunk := conn.recv(1 << 16):
            buf += chunk
            while len(buf) >= 4 and len(buf) >= 4 + int.from_bytes(buf[:4], "big"):
                n = int.from_bytes(buf[:4], "big")
                self.frames.append(json.loads(buf[4:4 + n]))
                buf = buf[4 + n:]

    def wait_for(self, pred, what: str, timeout: float = 10.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = next((f for f in self.frames if pred(f)), None)
            if got is not None:
                return got
            time.sleep(0.02)
        raise AssertionError(f"no {what} frame; got {self.frames}")


def start_front(binary: Path, sock: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([str(binary), "--listen", "127.0.0.1:0", "--pick-socket", str(sock)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    words = proc.stdout.readline().decode().split()
    assert words[0] == "listening", words
    return proc, f"127.0.0.1:{words[1]}"


def test_a_stream_that_ends_during_the_pick_tells_the_router_to_let_go(binary, tmp_path):
    router = ListeningRouter(tmp_path / "pick.sock")
    proc, address = start_front(binary, router.path)
    try:
        with grpc.insecure_channel(address) as ch:
            stub = pb_grpc.ExternalProcessorStub(ch)
            msgs = [headers_msg(POST, mode=epp.BODY_BUFFERED), body_msg(chat_body("hello"))]
            gate = threading.Event()

            def requests():
                yield from msgs
                gate.wait(30)  # keep the stream open until the test cancels it

            responses = stub.Process(requests())
            assert next(responses).WhichOneof("response") == "request_headers"  # BUFFERED: empty at once
            pick = router.wait_for(lambda f: f["t"] == "pick", "pick")
            assert pick["headers"][":path"] == POST[":path"] and pick["mode"] == epp.BODY_BUFFERED
            responses.cancel()  # the client went away; the router never answered
            gate.set()
            end = router.wait_for(lambda f: f["t"] == "end", "end")
            assert (end["id"], end["outcome"]) == (pick["id"], "aborted")
    finally:
        proc.terminate()
        proc.wait(10)


def test_without_its_router_the_front_answers_503_at_once(binary, tmp_path):
    proc, address = start_front(binary, tmp_path / "nobody.sock")
    try:
        with grpc.insecure_channel(address) as ch:
            stub = pb_grpc.ExternalProcessorStub(ch)
            out = list(stub.Process(iter([headers_msg(POST, eos=True, mode=epp.BODY_NONE)]), timeout=10))
        (answer,) = out
        assert answer.immediate_response.status.code == 503
        assert json.loads(answer.immediate_response.body)["error"]["code"] == "picker_unavailable"
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_front_exits_with_its_parent(binary, tmp_path):
    """The router starts the front; a router that dies (even by SIGKILL) takes it along."""
    script = (f"import os, subprocess, time; p = subprocess.Popen([{str(binary)!r}, '--pick-socket', "
              f"{str(tmp_path / 'x.sock')!r}, '--parent-pid', str(os.getpid())], stdout=subprocess.DEVNULL); "
              "print(p.pid, flush=True); time.sleep(60)")
    parent = subprocess.Popen(["python3", "-c", script], stdout=subprocess.PIPE)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    parent.kill()
    parent.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and running(child):
        time.sleep(0.1)
    assert not running(child), f"the front (pid {child}) outlived its parent"


def running(pid: int) -> bool:
    """Alive and not a zombie waiting for its reaper."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False

