"""`--kv-events-format llm-d`: kvmesh's KV event stream as llm-d's precise prefix-cache indexer reads it.

Real: the publisher (its ZeroMQ PUB socket on loopback) and `kvmesh serve`'s argument handling.
The reader is tests/support/llmd_kv.py, written from llm-d's Go code and sharing nothing with
kvmesh's wire module; it subscribes with llm-d's topic filter (``kv@``) on a plain SUB socket.
"""

from __future__ import annotations

import argparse
import time

import msgspec
import pytest
import zmq

from kvmesh.engine.kv.event_publisher import KVEventPublisher
from kvmesh.engine.kv.event_wire import LLMD_FORMAT, TopicError, TopicScheme, llmd_topic
from kvmesh.engine.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventLog,
    checkpoint_removed,
    checkpoint_stored,
)
from kvmesh.engine.server.cli import ServeArgsError, add_serve_arguments, settings_from_args
from kvmesh.engine.util.localproc import free_port_pair

from tests.support.llmd_kv import TOPIC_FILTER, LlmdIndex, parse_frames

BS = 4
POD = "10.244.0.7"
MODEL = "tiny-llama"


def _tokens(start: int, blocks: int) -> list[int]:
    return [start + i for i in range(blocks * BS)]


def _h(i: int) -> bytes:
    return i.to_bytes(32, "big")  # distinct in the last 8 bytes, which llm-d keys on


class Reader:
    """A SUB socket with llm-d's filter; ``sync`` waits until the subscription is live."""

    def __init__(self, pub: KVEventPublisher) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, TOPIC_FILTER)
        self.sub.connect(pub.endpoint)
        self.frames: list[list[bytes]] = []

    def sync(self, log: KVEventLog) -> None:
        """PUB drops what it sends before a subscription arrives: send cleared events (llm-d ignores
        them) until one comes through."""
        deadline = time.monotonic() + 10
        while not self.sub.poll(50):
            assert time.monotonic() < deadline, "subscription never became live"
            log.publish(AllBlocksCleared("cpu"))
        self.drain()
        self.frames.clear()

    def drain(self, quiet_ms: int = 300) -> list[list[bytes]]:
        while self.sub.poll(quiet_ms):
            self.frames.append(self.sub.recv_multipart())
        return self.frames

    def close(self) -> None:
        self.sub.close(0)
        self.ctx.term()


@pytest.fixture
def stream(request):
    token_ids = getattr(request, "param", True)
    log = KVEventLog("engine-a", capacity=1000)
    pub = KVEventPublisher("127.0.0.1", free_port_pair(), token_ids=token_ids,
                           scheme=TopicScheme(LLMD_FORMAT, POD))
    pub.start(log, model=MODEL)
    reader = Reader(pub)
    try:
        reader.sync(log)
        yield log, pub, reader
    finally:
        reader.close()
        pub.close()


def test_llmd_indexer_places_the_cached_prefix_on_the_pod(stream):
    log, pub, reader = stream
    assert pub.topic == f"kv@{POD}@{MODEL}".encode()
    a = _tokens(100, 3)
    b = _tokens(500, 2)
    # A chain of 3 blocks from the root, then 2 more that continue it (their parent is a's last).
    log.publish(BlockStored([_h(1), _h(2), _h(3)], None, a, BS))
    log.publish(BlockStored([_h(4), _h(5)], _h(3), b, BS))
    index = LlmdIndex(BS)
    msgs = [parse_frames(f) for f in reader.drain()]
    assert [(m.pod, m.model) for m in msgs] == [(POD, MODEL)] * 2
    assert [m.seq for m in msgs] == sorted(m.seq for m in msgs) and msgs[1].seq == msgs[0].seq + 1
    for m in msgs:
        index.digest(m)
    assert index.dropped == []
    assert index.longest_prefix(a + b + [1, 2], MODEL, POD) == 5
    assert index.longest_prefix(a + b, "another-model", POD) == 0  # keys are per model
    assert index.longest_prefix(a + b, MODEL, "10.244.0.8") == 0

    # Evicting the 4th block cuts the prefix there; clears change nothing (llm-d ignores them, and
    # skips a clear of another tier, which carries kvmesh's extra medium field, as undecodable).
    log.publish(BlockRemoved([_h(4)]))
    log.publish(AllBlocksCleared())
    log.publish(AllBlocksCleared("cpu"))
    for f in reader.drain()[2:]:
        index.digest(parse_frames(f))
    assert index.dropped == ["AllBlocksCleared: number of fields in array-encoded struct has changed"]
    assert index.longest_prefix(a + b, MODEL, POD) == 3


def test_llmd_indexer_ignores_checkpoint_records(stream):
    """A hybrid engine's checkpoint records (medium ``state-gpu``, no tokens) change nothing in
    llm-d's index: the stored one is dropped (no tokens, so no keys), the removed one only touches
    the (pod, state-gpu) entry, which never existed, so the KV blocks stay placed on the pod."""
    log, _, reader = stream
    a = _tokens(100, 3)
    log.publish(BlockStored([_h(1), _h(2), _h(3)], None, a, BS))
    log.publish(checkpoint_stored([_h(2), _h(3)], BS))
    log.publish(checkpoint_removed([_h(3)]))
    log.publish(checkpoint_removed([_h(2)]))
    index = LlmdIndex(BS)
    for f in reader.drain():
        index.digest(parse_frames(f))
    assert index.dropped == ["BlockStored: no keys or entries provided for adding to index"]
    assert index.longest_prefix(a, MODEL, POD) == 3
    assert {t for held in index.pods.values() for _, t in held} == {"gpu"}


@pytest.mark.parametrize("stream", [False], indirect=True)
def test_without_token_ids_the_indexer_drops_every_block(stream):
    """Why `--kv-events-format llm-d` refuses to start without `--kv-events-token-ids`."""
    log, _, reader = stream
    log.publish(BlockStored([_h(1)], None, _tokens(100, 1), BS))
    index = LlmdIndex(BS)
    for f in reader.drain():
        index.digest(parse_frames(f))
    assert index.dropped == ["BlockStored: no keys or entries provided for adding to index"]


def test_topic_names_are_checked():
    assert llmd_topic("10.0.0.1", "org/model") == b"kv@10.0.0.1@org/model"
    assert TopicScheme().topic("e1", "m") == b"kv-events/e1"
    assert TopicScheme(LLMD_FORMAT).topic("e1", "m") == b"kv@e1@m"  # no pod: the engine id
    for pod, model in (("a@b", "m"), ("p", "m@1"), ("p", "")):
        with pytest.raises(TopicError, match="kv@<pod>@<model>"):
            TopicScheme(LLMD_FORMAT, pod).topic("e1", model)
    with pytest.raises(TopicError, match="unknown KV event format"):
        TopicScheme("vllm")


def _settings(*argv: str):
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return settings_from_args(p.parse_args(list(argv)))


def test_serve_flags(monkeypatch):
    monkeypatch.delenv("POD_IP", raising=False)
    on = ("--kv-events-port", "5557", "--kv-events-format", "llm-d")
    s = _settings(*on, "--kv-events-token-ids", "--kv-events-pod", "pod-1")
    assert (s.kv_events_format, s.kv_events_pod, s.kv_events_token_ids) == ("llm-d", "pod-1", True)
    monkeypatch.setenv("POD_IP", "10.1.2.3")
    assert _settings(*on, "--kv-events-token-ids").kv_events_pod == "10.1.2.3"
    assert _settings("--kv-events-port", "5557").kv_events_format == "kvmesh"
    for argv, complaint in (
            (on, "needs --kv-events-token-ids"),
            (("--kv-events-format", "llm-d", "--kv-events-token-ids"), "needs --kv-events-port"),
            ((*on, "--kv-events-token-ids", "--kv-events-pod", "a@b"), "contains @"),
            ((*on, "--kv-events-token-ids", "--served-model-name", "m@2"), "contains @"),
            (("--kv-events-port", "5557", "--kv-events-pod", "p"), "add --kv-events-format llm-d")):
        with pytest.raises(ServeArgsError, match=complaint):
            _settings(*argv)


@pytest.fixture(scope="module")
def llmd_server(tmp_path_factory):
    """`kvmesh serve --kv-events-format llm-d` (tiny random Llama, real engine in its own process)."""
    from tests.support.processes import ServerProcess
    from tests.support.tiny_models import make_tiny_hf_model

    model = make_tiny_hf_model("llama", tmp_path_factory.mktemp("model"))
    port = free_port_pair()
    proc = ServerProcess("--model", str(model), "--served-model-name", MODEL, "--dtype", "float32",
                         "--block-size", str(BS), "--num-kv-blocks", "128", "--max-model-len", "96",
                         "--kv-events-port", str(port), "--kv-events-format", "llm-d", "--kv-events-token-ids",
                         "--kv-events-pod", POD)
    proc.start()
    try:
        yield proc, port
    finally:
        proc.stop()


def _complete(proc, prompts: list[list[int]]) -> None:
    import httpx

    with httpx.Client(base_url=proc.base_url, timeout=60) as client:
        for p in prompts:
            r = client.post("/v1/completions", json={"prompt": p, "max_tokens": 2, "temperature": 0,
                                                     "ignore_eos": True})
            assert r.status_code == 200, r.text


def _prompts(seed: int) -> list[list[int]]:
    prompts = [[(seed + 7 * i + 3 * j) % 900 + 20 for j in range(4 * BS + i)] for i in range(3)]
    prompts.append(prompts[0][:2 * BS] + [5, 6, 7, 8, 9, 10, 11, 12, 13])  # shares 2 blocks with prompts[0]
    return prompts


@pytest.mark.slow  # a real server process: about 15 s
def test_a_real_engine_stream_indexes_every_prompt_block(llmd_server):
    """After some requests, the llm-d reader places each prompt's full blocks on the pod, and
    /kv/info names the topic the engine publishes under."""
    import httpx

    proc, port = llmd_server
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        info = httpx.get(proc.url("/kv/info")).json()
        assert info["kv_events"]["topic"] == f"kv@{POD}@{MODEL}" and info["kv_events"]["format"] == "llm-d"
        assert info["block_size"] == BS
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC_FILTER)
        sub.connect(f"tcp://127.0.0.1:{port}")
        time.sleep(0.5)  # the subscription reaches the PUB socket before anything is published
        prompts = _prompts(0)
        _complete(proc, prompts)
        index = LlmdIndex(BS)
        seqs = []
        while sub.poll(1000):
            msg = parse_frames(sub.recv_multipart())
            assert (msg.pod, msg.model) == (POD, MODEL)
            seqs.append(msg.seq)
            index.digest(msg)
        assert seqs and seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # nothing lost
        assert index.dropped == []
        for p in prompts:
            assert index.longest_prefix(p, MODEL, POD) == len(p) // BS, p
        assert index.longest_prefix([1, 2, 3, 4] + prompts[0], MODEL, POD) == 0
    finally:
        sub.close(0)
        ctx.term()


@pytest.fixture(scope="module")
def llmd_indexer_binary():
    """llm-d's KV-cache indexer built from its Go module (e2e/build-binaries llmd-indexer; cached)."""
    import shutil
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    if shutil.which("go") is None:
        pytest.skip("no Go toolchain: llm-d's indexer is built from its Go module")
    if subprocess.run(["pkg-config", "--exists", "libzmq"]).returncode != 0:
        pytest.skip("libzmq3-dev and pkg-config are not installed (scripts/setup-e2e-node installs them)")
    script = root / "e2e" / "build-binaries"
    subprocess.run([str(script), "llmd-indexer"], check=True)
    out = subprocess.run([str(script), "--print-dirs", "llmd-indexer"], capture_output=True, text=True,
                         check=True).stdout
    return Path(out.strip().split("=", 1)[1]) / "llmd-indexer"


class Indexer:
    """The llmd-indexer process: llm-d's subscriber on the engine's PUB socket, lookups over stdio."""

    def __init__(self, binary, endpoint: str) -> None:
        import subprocess

        self.proc = subprocess.Popen([str(binary), "-endpoint", endpoint, "-block-size", str(BS)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == '{"ready": true}'

    def prefix(self, tokens: list[int], model: str = MODEL, pod: str = POD) -> int:
        import json

        self.proc.stdin.write(json.dumps({"tokens": tokens, "model": model, "pods": [pod]}) + "\n")
        self.proc.stdin.flush()
        got = json.loads(self.proc.stdout.readline())
        assert not got.get("error"), got
        return got["prefix"][pod]

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except Exception:
            self.proc.kill()
            self.proc.wait(10)


def _wait_subscribed(indexer: Indexer, proc) -> None:  # noqa: ANN001 - the server fixture's process
    """llm-d's subscriber connects in the background and misses what is published before: send
    fresh two-block prompts until one is indexed."""
    deadline = time.monotonic() + 60
    probe = 0
    while True:
        probe += 1
        warm = [probe % 50 + 900] + [(probe * 13 + j) % 800 + 30 for j in range(2 * BS - 1)]
        _complete(proc, [warm])
        time.sleep(0.3)
        if indexer.prefix(warm) == 2:
            return
        assert time.monotonic() < deadline, "llm-d's indexer never indexed anything"


def _wait_indexed(indexer: Indexer, prompts: list[list[int]]) -> None:
    """Each prompt's full blocks are found on the pod within 20 s."""
    for p in prompts:
        want = len(p) // BS
        deadline = time.monotonic() + 20
        while indexer.prefix(p) != want:
            assert time.monotonic() < deadline, (p, indexer.prefix(p), want)
            time.sleep(0.1)


@pytest.mark.slow  # a real server process, and a Go build on the first run
def test_llmd_indexer_itself_indexes_a_real_engine(llmd_server, llmd_indexer_binary):
    """llm-d's own indexer (built from github.com/llm-d/llm-d-kv-cache v0.5.0: its ZMQ subscriber,
    event pool, in-memory index and token processor, unchanged) subscribed to a real engine's
    stream finds every prompt's full blocks on the pod the topic names."""
    proc, port = llmd_server
    indexer = Indexer(llmd_indexer_binary, f"tcp://127.0.0.1:{port}")
    try:
        _wait_subscribed(indexer, proc)
        prompts = _prompts(41)
        _complete(proc, prompts)
        _wait_indexed(indexer, prompts)
        assert indexer.prefix(prompts[0], model="another-model") == 0  # keys are per model
        assert indexer.prefix(prompts[0], pod="10.244.0.99") == 0
        assert indexer.prefix([3, 1, 4, 1] + prompts[0]) == 0
    finally:
        indexer.close()


# ---- a hybrid engine's stream: checkpoint records beside the KV blocks --------------------------------


@pytest.fixture(scope="module")
def hybrid_llmd_server(tmp_path_factory):
    """`kvmesh serve --kv-events-format llm-d` on a tiny random Qwen3.5 text model (a checkpoint
    every 16 tokens), real engine in its own process."""
    from tests.support.processes import ServerProcess
    from tests.support.tiny_hybrid import make_tiny_hybrid_model

    model = make_tiny_hybrid_model(tmp_path_factory.mktemp("hybrid-model"))
    port = free_port_pair()
    proc = ServerProcess("--model", str(model), "--served-model-name", MODEL, "--dtype", "float32",
                         "--block-size", str(BS), "--num-kv-blocks", "128", "--max-model-len", "96",
                         "--state-checkpoint-interval", "16", "--kv-events-port", str(port),
                         "--kv-events-format", "llm-d", "--kv-events-token-ids", "--kv-events-pod", POD)
    proc.start()
    try:
        yield proc, port
    finally:
        proc.stop()


def _hybrid_prompts(seed: int) -> list[list[int]]:
    prompts = _prompts(seed)
    return prompts + [prompts[0] + [21, 22, 23, 24, 25]]  # extends prompts[0]: resumes from a checkpoint


@pytest.mark.slow  # a real server process: about 20 s
def test_a_real_hybrid_engine_stream_indexes_every_prompt_block(hybrid_llmd_server):
    """A hybrid engine's stream through the llm-d reader: checkpoint records arrive (medium
    state-gpu), each stored one (and each branch point's, medium branch) is dropped for want of
    tokens, nothing else is, and every
    prompt's full blocks are placed on the pod exactly as for an attention-only engine."""
    proc, port = hybrid_llmd_server
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC_FILTER)
        sub.connect(f"tcp://127.0.0.1:{port}")
        time.sleep(0.5)  # the subscription reaches the PUB socket before anything is published
        prompts = _hybrid_prompts(3)
        _complete(proc, prompts)
        index = LlmdIndex(BS)
        media = []
        while sub.poll(1000):
            msg = parse_frames(sub.recv_multipart())
            media += [ev[-2] if ev[0] == "BlockStored" else ev[-1] for ev in msgspec.msgpack.decode(msg.payload)[1]]
            index.digest(msg)
        assert "state-gpu" in media and "gpu" in media
        stored_ckpts = sum(1 for m in media if m in ("state-gpu", "branch"))  # stored and removed
        assert index.dropped and set(index.dropped) == {"BlockStored: no keys or entries provided for adding to index"}
        assert len(index.dropped) <= stored_ckpts
        for p in prompts:
            assert index.longest_prefix(p, MODEL, POD) == len(p) // BS, p
        assert {t for held in index.pods.values() for _, t in held} == {"gpu"}
    finally:
        sub.close(0)
        ctx.term()


@pytest.fixture(scope="module")
def llmd_indexer_prebuilt():
    """llm-d's indexer only if `e2e/build-binaries llmd-indexer` already built it (a first build
    takes 12 min or more on a shared 2-core machine, so this test does not start one)."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([str(root / "e2e" / "build-binaries"), "--print-dirs", "llmd-indexer"],
                         capture_output=True, text=True, check=True).stdout
    binary = Path(out.strip().split("=", 1)[1]) / "llmd-indexer"
    if not binary.exists():
        pytest.skip(f"llm-d's indexer is not built ({binary} missing): run e2e/build-binaries llmd-indexer "
                    "first (test_llmd_indexer_itself_indexes_a_real_engine builds it)")
    return binary


@pytest.mark.slow  # a real server process and a prebuilt Go binary
def test_llmd_indexer_itself_ignores_a_hybrid_engines_checkpoints(hybrid_llmd_server, llmd_indexer_prebuilt):
    """llm-d's own indexer on a hybrid engine's stream finds every prompt's full blocks on the pod:
    the checkpoint records among them change nothing."""
    proc, port = hybrid_llmd_server
    indexer = Indexer(llmd_indexer_prebuilt, f"tcp://127.0.0.1:{port}")
    try:
        _wait_subscribed(indexer, proc)
        prompts = _hybrid_prompts(57)
        _complete(proc, prompts)
        _wait_indexed(indexer, prompts)
    finally:
        indexer.close()
