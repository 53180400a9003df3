"""Prefill -> decode handoffs of a hybrid (Qwen3.5 text) model carry the recurrent state.

Real: both engines (a tiny random Qwen3_5ForCausalLM that transformers wrote, fp32), their KV
managers, state slots and checkpoints, the handoff state on each side; in the transport tests
also the decode engine's UCX endpoint (``DecodeEndpoint``, the listener ``kvmesh serve --role
decode`` runs) and the prefill side's ``DecodeLinks``, over UCX and over the same-host shm lane.
Not here: the HTTP servers and the router (tests/up/test_up_hybrid_pd.py runs those). The
reference is transformers' own greedy generate, so a state that was lost, stale, or landed in
the wrong slot shows up as a token difference (a decode engine that ignores the pushed state
differs from it on these prompts).
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future

import msgspec
import pytest
import torch

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.disagg.decode_link import DecodeEndpoint
from kvmesh.engine.disagg.prefill_link import DecodeLinks
from kvmesh.engine.disagg.errors import TransferMismatch
from kvmesh.engine.disagg.prefill_side import DECODE
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.kv.gather import cache_layout
from kvmesh.engine.kv.slot_wire import slot_state_layout
from kvmesh.engine.roles import DecodeClaim, PrefillHandoff
from kvmesh.engine.sampling import SamplingParams
from kvmesh.engine.transfer import protocol
from kvmesh.engine.transfer.client import AsyncKVClient
from kvmesh.engine.transfer.errors import TransferError
from kvmesh.engine.transfer.header import StateBufferSpec, state_layout
from kvmesh.engine.transfer.loop_thread import shared_loop

from tests.support.handoff import handoff_once
from tests.support.tiny_hybrid import hf_greedy, make_tiny_hybrid_model

pytestmark = pytest.mark.timeout(300)

MAX_NEW = 12
_g = torch.Generator().manual_seed(3)
# A 1-token prompt, one inside the first block, and prompts past a 64-token DeltaNet chunk and
# several 16-token blocks (with a partial tail block).
PROMPTS = [torch.randint(3, 1000, (n,), generator=_g).tolist() for n in (1, 9, 37, 70, 130)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hybrid_model(tmp_path_factory.mktemp("hybrid-pd"))


@pytest.fixture(scope="module")
def reference(model_dir):
    return [toks for toks, _ in hf_greedy(model_dir, PROMPTS, MAX_NEW)]


def _engine(model_dir, **cfg) -> LLMEngine:
    cfg = {"num_kv_blocks": 64, "state_checkpoint_interval": 32, **cfg}
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", **cfg), debug_checks=True)


def _greedy(n: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _idle(*engines: LLMEngine) -> None:
    for e in engines:
        e.check_integrity()
        assert not e.kv.requests, e.kv.requests  # nothing held, nothing reserved
        assert len(e.prefill) == 0 and len(e.decode) == 0
        assert not e.state_slots.owners()


def test_in_process_handoff_equals_transformers(model_dir, reference):
    """Prefill in chunks that are not block multiples, the state at the prompt's end handed over
    with the KV: the decode engine continues exactly where transformers does."""
    p = _engine(model_dir, max_num_batched_tokens=23)
    d = _engine(model_dir)
    for i, prompt in enumerate(PROMPTS):
        _, h, toks = handoff_once(p, d, i, prompt, _greedy())
        assert toks == reference[i], f"prompt {i} (len {len(prompt)})"
        assert h.state is not None and h.state.numel() == d.decode.transfers.state_bytes == 16896
    _idle(p, d)


def test_a_repeated_prompt_resumes_from_the_prefill_checkpoint_and_still_carries_the_state(model_dir, reference):
    """The second handoff of a prompt is a hybrid prefix hit on the prefill engine (a checkpoint at
    its last boundary) and on the decode engine (its KV blocks); the state still comes along."""
    p, d = _engine(model_dir), _engine(model_dir)
    handoff_once(p, d, 0, PROMPTS[4], _greedy())
    res, h, toks = handoff_once(p, d, 1, PROMPTS[4], _greedy())
    assert toks == reference[4]
    assert h.first.cached_tokens == (len(PROMPTS[4]) - 1) // 16 * 16 and res.hit_blocks > 0
    _idle(p, d)


def test_a_final_push_without_the_state_is_refused(model_dir):
    p, d = _engine(model_dir), _engine(model_dir)
    fut = d.decode.reserve("t", PROMPTS[2], MAX_NEW)
    d.idle_tick()
    fut.result(0)
    p.add_request("r", PROMPTS[2], _greedy(), handoff=PrefillHandoff(0))
    while not (outs := [o for o in p.step() if o.finished]):
        pass
    h = outs[0].handoff
    fill = d.decode.fill("t", h.start, h.data, True, h.first)  # no state
    d.idle_tick()
    with pytest.raises(TransferMismatch, match="must carry the recurrent state"):
        fill.result(0)
    d.decode.cancel("t")
    p.prefill.release("r", DECODE)
    p.idle_tick(), d.idle_tick()
    _idle(p, d)


# ---- over the real transport ------------------------------------------------------------------
class Driver:
    """Runs an engine's steps on a thread of its own, as the server's engine thread does."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.outs: list = []
        self._stop = threading.Event()
        self._wake = threading.Event()
        engine.wake = self._wake.set
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        e = self.engine
        while not self._stop.is_set():
            busy = e.has_unfinished_requests()
            self.outs += e.step() if busy else e.idle_tick()
            if not busy:
                self._wake.wait(0.005)
                self._wake.clear()

    def tokens(self, rid: str, timeout: float = 120.0) -> list[int]:
        deadline = time.monotonic() + timeout
        while not any(o.request_id == rid and o.finished for o in list(self.outs)):
            assert time.monotonic() < deadline, f"{rid} did not finish"
            time.sleep(0.01)
        return [t for o in list(self.outs) if o.request_id == rid for t in o.new_token_ids]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        self.engine.wake = None


def _links(p: LLMEngine) -> DecodeLinks:
    layout = cache_layout(p.kv.extra, p.runner.kv_cache)
    return DecodeLinks(layout, timeout_s=20.0, connect_timeout_s=5.0,
                       state_layout=slot_state_layout(layout, p.runner.states, p.model_config.linear_layers))


def _prefill_parts(p: LLMEngine, rid: str, prompt: list[int], start: int):
    """Run a streamed prefill handoff on ``p``: the parts as chunks complete, then the final one."""
    p.add_request(rid, prompt, _greedy(), handoff=PrefillHandoff(start, stream=True))
    parts = []
    while True:
        for o in p.step():
            if o.handoff is not None:
                parts.append(o.handoff)
            if o.finished:
                assert o.finish_reason == "transfer"
                return parts


def _handoff(p: LLMEngine, d: Driver, links: DecodeLinks, port: int, tid: str, prompt: list[int]) -> list[int]:
    """Stage 1 (reserve, prefill, push every part) and stage 2 (claim) over the transport."""
    res = asyncio.run(links.reserve("127.0.0.1", port, tid, prompt, MAX_NEW))
    parts = _prefill_parts(p, f"p-{tid}", prompt, res.hit_blocks)
    try:
        for i, part in enumerate(parts):
            asyncio.run(links.push("127.0.0.1", port, tid, part, final=i == len(parts) - 1))
    finally:
        p.prefill.release(f"p-{tid}", DECODE)
        p.idle_tick()
    assert parts[-1].state is not None and all(x.state is None for x in parts[:-1])
    claimed: Future = Future()
    d.engine.add_request(f"d-{tid}", prompt, _greedy(), handoff=DecodeClaim(tid, claimed))
    toks = d.tokens(f"d-{tid}")
    assert claimed.exception(0) is None
    return toks


@pytest.fixture(params=["ucx", "shm"])
def lane(request, monkeypatch):
    monkeypatch.setenv("KVMESH_KV_SHM", "1" if request.param == "shm" else "0")
    return request.param


def test_handoff_over_the_transport_equals_transformers(model_dir, reference, lane):
    p = _engine(model_dir, max_num_batched_tokens=40)  # several parts per long prompt
    d = _engine(model_dir)
    ep, links, drv = DecodeEndpoint(d), _links(p), Driver(d)
    try:
        for i in (1, 3, 4):
            assert _handoff(p, drv, links, ep.port, f"{lane}-{i}", PROMPTS[i]) == reference[i], f"prompt {i}"
        assert ep.handler.bytes_received > 3 * 16896
    finally:
        drv.stop()
        links.close()
        ep.close()
    _idle(p, d)


def test_a_reservation_whose_state_layout_differs_is_refused_before_any_byte(model_dir):
    """The real receiver checks the state layout field by field at reservation: each mismatch is
    answered ``header_mismatch`` naming the field, counted, and reserves nothing."""
    d = _engine(model_dir)
    ep, drv = DecodeEndpoint(d), Driver(d)
    kv = ep.handler.layout
    own = list(ep.handler.state_layout.state)
    names = [b.name for b in own]
    assert names == ["conv.0", "conv.1", "conv.2", "ssm.0", "ssm.1", "ssm.2"]  # the tiny model's 3 DeltaNet layers

    def changed(name: str, **field) -> list[StateBufferSpec]:
        return [msgspec.structs.replace(b, **field) if b.name == name else b for b in own]

    variants = {
        "state": None,  # a prefill engine whose model keeps no recurrent state
        "state[conv.1]": state_layout(kv, changed("conv.1", shape=(own[1].shape[0], 2))),  # another conv kernel
        "state[ssm.0]": state_layout(kv, changed("ssm.0", dtype="bfloat16")),  # a rounded recurrent state
        "state[conv.2]": state_layout(kv, [*own[:2], *own[3:5]]),  # one DeltaNet layer fewer
    }
    client = AsyncKVClient("127.0.0.1", ep.port, timeout=10.0)
    loop = shared_loop()
    try:
        for n, (field, layout) in enumerate(variants.items(), 1):
            reply = loop.call(client.reserve(f"bad-{n}", kv, PROMPTS[2], MAX_NEW, state=layout), timeout=30)
            assert isinstance(reply, protocol.ErrorReply), reply
            assert reply.kind == protocol.ERR_HEADER and reply.field == field, reply
            assert ep.handler.header_mismatches == n
        # A push for what was refused finds nothing: no reservation, not a byte read.
        ok = loop.call(client.reserve("good", kv, PROMPTS[2], MAX_NEW, state=ep.handler.state_layout), timeout=30)
        assert isinstance(ok, protocol.Reserved)
        bad = protocol.PushKV("good", 0, [None] * 3, True, protocol.FirstToken(5), state=False)
        with pytest.raises(TransferError, match="recurrent state"):
            loop.call(client.push(bad, []), timeout=30)
        loop.call(client.cancel("good"), timeout=30)
    finally:
        loop.call(client.aclose(), timeout=10)
        drv.stop()
        ep.close()
    assert ep.handler.bytes_received == 0
    d.idle_tick()
    _idle(d)
    # The message survives the wire as it is: an old peer's Reserve (no state field) decodes.
    old = msgspec.msgpack.encode(["reserve", "t", kv, [5], 1, b""])
    assert protocol.decode(old).state is None


def test_a_dead_decode_peer_mid_transfer_falls_back_to_recompute(model_dir, reference, lane):
    """The decode engine's listener dies after the first part: the final push fails, the prefill
    engine frees what it held, and the request, started over, is recomputed: on the prefill
    engine from its checkpoint (only the suffix), on the restarted decode engine from the pushed
    state; the tokens still equal transformers'."""
    p = _engine(model_dir, max_num_batched_tokens=40)
    d = _engine(model_dir)
    ep, links, drv = DecodeEndpoint(d), _links(p), Driver(d)
    prompt = PROMPTS[4]
    try:
        res = asyncio.run(links.reserve("127.0.0.1", ep.port, "t1", prompt, MAX_NEW))
        parts = _prefill_parts(p, "p1", prompt, res.hit_blocks)
        assert len(parts) > 1
        asyncio.run(links.push("127.0.0.1", ep.port, "t1", parts[0], final=False))
        ep.close()  # the decode side dies mid-transfer
        with pytest.raises(TransferError):
            asyncio.run(links.push("127.0.0.1", ep.port, "t1", parts[-1], final=True))
        p.prefill.release("p1", DECODE)
        p.idle_tick()
        deadline = time.monotonic() + 30
        while len(d.decode):  # its connection dropped: the reservation (and no state) is freed
            assert time.monotonic() < deadline, "the decode engine kept the dead transfer"
            time.sleep(0.01)
        ep = DecodeEndpoint(d)  # restarted listener; the router starts the request over
        assert _handoff(p, drv, links, ep.port, "t2", prompt) == reference[4]
        # ... and a decode engine serving the prompt itself (no prefill engine left) agrees.
        d.add_request("plain", prompt, _greedy())
        assert drv.tokens("plain") == reference[4]
    finally:
        drv.stop()
        links.close()
        ep.close()
    _idle(p, d)
