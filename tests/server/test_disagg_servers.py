"""Prefill and decode engines as real `kvmesh serve` processes talking over UCX (slow).

Real: two server processes on the default model (one torch thread each), the UCX link between
them, the HTTP contract of docs/disagg.md driven by hand (the router's side of it is tested in
tests/router). The reference for the tokens is the decode engine serving the same request
colocated; a wrong byte of KV or a lost first token shows up as different text.
"""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from tests.support.listening import listening_sockets
from tests.support.processes import ServerProcess
from tests.support.waits import nothing_held, wait_metric

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # prefill and decode servers: about 4.5 min

QUESTION = "What is the capital of France?"


def _body(content: str = QUESTION, max_tokens: int = 16, **extra) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **extra}


@pytest.fixture(scope="module")
def decode():
    d = ServerProcess("--role", "decode", "--num-threads", "1", "--num-kv-blocks", "64").start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def prefill():
    p = ServerProcess("--role", "prefill", "--num-threads", "1", "--num-kv-blocks", "512",
                      "--kv-transfer-timeout", "4").start()
    yield p
    p.stop()


def transfer_port(d: ServerProcess) -> int:
    return httpx.get(d.url("/kv/info"), timeout=10).json()["transfer_port"]


def stage1(p: ServerProcess, d: ServerProcess, tid: str, body: dict, timeout: float = 120,
           port: int | None = None) -> httpx.Response:
    kvp = {"transfer_id": tid, "decode_host": "127.0.0.1", "decode_port": port or transfer_port(d)}
    return httpx.post(p.url("/v1/chat/completions"), json={**body, "kv_transfer_params": kvp}, timeout=timeout)


def stage2(d: ServerProcess, tid: str, body: dict) -> httpx.Response:
    return httpx.post(d.url("/v1/chat/completions"), json={**body, "kv_transfer_params": {"transfer_id": tid}},
                      timeout=120)


def test_handoff_answers_what_the_decode_engine_computes_itself(prefill, decode):
    prompts = [QUESTION, "Write a haiku about the sea.", "List three prime numbers. " * 12]
    for i, q in enumerate(prompts):
        body = _body(q)
        info = stage1(prefill, decode, f"same-{i}", body)
        assert info.status_code == 200, info.text
        doc = info.json()
        assert doc["object"] == "kv_transfer" and doc["blocks_sent"] >= 1 and doc["bytes_sent"] > 0
        got = stage2(decode, f"same-{i}", body)
        assert got.status_code == 200, got.text
        # The same request served colocated by the decode engine (its prefix cache now holds the
        # transferred prompt blocks, so only the last partial block is recomputed).
        ref = httpx.post(decode.url("/v1/chat/completions"), json=body, timeout=120).json()
        assert got.json()["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]
        assert got.json()["usage"]["completion_tokens"] == 16
        assert got.json()["usage"]["prompt_tokens"] == doc["prompt_tokens"]
    # Streamed stage 2, and a second transfer of a prompt the decode engine caches already.
    body = _body(prompts[0], stream=True, stream_options={"include_usage": True})
    doc = stage1(prefill, decode, "stream", body).json()
    assert doc["decode_hit_blocks"] >= 1 and doc["cached_tokens"] > 0
    with httpx.stream("POST", decode.url("/v1/chat/completions"),
                      json={**body, "kv_transfer_params": {"transfer_id": "stream"}}, timeout=120) as r:
        text = "".join(r.iter_text())
    assert text.rstrip().endswith("data: [DONE]") and '"completion_tokens":16' in text
    assert prefill.metric("kvmesh_kv_handoffs_total", outcome="ok") >= 4
    nothing_held(prefill, decode)


def test_wrong_stage_wrong_role_and_unknown_transfers(prefill, decode):
    r = stage2(decode, "never-reserved", _body())
    assert r.status_code == 409 and r.json()["error"]["code"] == "transfer_not_found"
    r = stage2(prefill, "x", _body())
    assert r.status_code == 400 and r.json()["error"]["code"] == "wrong_role"
    r = stage1(decode, decode, "x", _body())
    assert r.status_code == 400 and r.json()["error"]["code"] == "wrong_role"
    r = stage1(prefill, decode, "n2", _body(n=2))
    assert r.status_code == 400 and r.json()["error"]["code"] == "n_not_supported"
    r = httpx.post(prefill.url("/v1/chat/completions"),
                   json={**_body(), "kv_transfer_params": {"transfer_id": "t", "decode_host": "127.0.0.1",
                                                           "decode_port": 1}}, timeout=60)
    assert r.status_code == 502 and r.json()["error"]["code"] == "decode_unreachable"
    r = httpx.post(prefill.url("/v1/chat/completions"),
                   json={**_body(), "kv_transfer_params": {"transfer_id": "t", "bogus": 1}}, timeout=60)
    assert r.status_code == 400
    nothing_held(prefill, decode)


def test_decode_refuses_without_room_and_nothing_leaks(prefill, decode):
    # 64 blocks of 16 tokens: ~37 prompt tokens + 1200 can never fit; a ~630-token prompt + 100
    # fits once, not twice (the reservation counts prompt and output alike; a long prompt keeps
    # the decode that proves the reservation covers the whole output short).
    r = stage1(prefill, decode, "huge", _body(max_tokens=1200))
    assert r.status_code == 400 and r.json()["error"]["code"] == "decode_too_large"
    # Two different prompts: the second must not share the first's reserved prompt blocks.
    big, other = (_body(f"List {n} prime numbers. " * 100, max_tokens=100) for n in ("three", "four"))
    first = stage1(prefill, decode, "big-1", big)
    assert first.status_code == 200, first.text
    assert 520 <= first.json()["prompt_tokens"] + 100 <= 1024, first.json()
    r = stage1(prefill, decode, "big-2", other)
    assert r.status_code == 503 and r.json()["error"]["code"] == "decode_no_room"
    assert r.headers.get("retry-after") == "1"
    assert decode.metric("kvmesh_kv_transfers_reserved") == 1
    done = stage2(decode, "big-1", big)
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 100
    nothing_held(prefill, decode)


def test_stalled_decode_times_out_and_both_sides_free_their_blocks(prefill, decode):
    """The decode engine stops answering (SIGSTOP) during a handoff: the prefill side gives up after
    its transfer timeout with 502 decode_failed and frees its blocks; once the decode engine runs
    again it frees the reservation the dropped connection left."""
    port = transfer_port(decode)
    decode.signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        r = stage1(prefill, decode, "stalled", _body(), port=port)
        assert r.status_code == 502 and r.json()["error"]["code"] == "decode_failed", r.text
        assert time.monotonic() - t0 < 30
        wait_metric(prefill, "kvmesh_kv_handoffs_held", 0)
    finally:
        decode.signal(signal.SIGCONT)
    nothing_held(prefill, decode)
    assert stage1(prefill, decode, "after", _body()).status_code == 200  # both sides recovered
    assert stage2(decode, "after", _body()).status_code == 200


def test_a_tail_cut_prefill_pushes_before_its_first_token_and_stays_exact(decode):
    """`--kv-transfer-tail-tokens`: with a 16-token tail, a ~110-token prompt (one chunk under the
    default budget) runs to the last block boundary 16+ tokens before its end, pushes those blocks,
    then runs the tail, and only the tail's blocks are pushed after the first token. The answer
    equals the decode engine's own cold answer (another cache salt: nothing transferred is used).
    Without the tail, the same prompt goes in one part fewer and the same bytes."""
    flags = ("--role", "prefill", "--num-threads", "1", "--num-kv-blocks", "512")
    cut = ServerProcess(*flags, "--kv-transfer-tail-tokens", "16").start()
    uncut = ServerProcess(*flags, "--kv-transfer-tail-tokens", "0").start()
    try:
        docs = {}
        for name, p in (("cut", cut), ("uncut", uncut)):
            # A salt per engine: the second transfer finds none of the first one's blocks.
            body = _body("List three prime numbers. " * 15, cache_salt=name)
            info = stage1(p, decode, f"tail-{name}", body)
            assert info.status_code == 200, info.text
            docs[name] = info.json()
            got = stage2(decode, f"tail-{name}", body)
            assert got.status_code == 200, got.text
            ref = httpx.post(decode.url("/v1/chat/completions"), json={**body, "cache_salt": f"cold-{name}"},
                             timeout=120).json()
            assert ref["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert got.json()["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]
        assert docs["cut"]["prompt_tokens"] >= 48  # room for 16+ tokens before the cut and 16+ after
        assert (docs["uncut"]["parts"], docs["cut"]["parts"]) == (1, 2)
        assert docs["cut"]["bytes_sent"] == docs["uncut"]["bytes_sent"]
        nothing_held(cut, decode)
        nothing_held(uncut, decode)
    finally:
        cut.stop()
        uncut.stop()


def test_prefill_killed_mid_prefill_frees_the_decode_reservation(decode):
    p = ServerProcess("--role", "prefill", "--num-threads", "1", "--num-kv-blocks", "512",
                      "--max-num-batched-tokens", "16").start()
    try:
        # ~800 tokens (fits the decode engine's 64 blocks), prefilled 16 tokens a step: seconds.
        long_prompt = " ".join(f"w{i % 97} {i}." for i in range(110))
        result: list = []
        t = threading.Thread(target=lambda: result.append(_safe(lambda: stage1(p, decode, "killed",
                                                                                 _body(long_prompt, 8)))))
        t.start()
        wait_metric(decode, "kvmesh_kv_transfers_reserved", 1, timeout=60)
        p.signal(signal.SIGKILL)
        t.join(60)
        assert result and isinstance(result[0], httpx.HTTPError)
    finally:
        p.stop()
    # The dropped UCX connection frees the reservation at once (well before the 30 s timeout).
    wait_metric(decode, "kvmesh_kv_transfers_reserved", 0, timeout=10)
    total = decode.metric("kvmesh_kv_cache_blocks", tier="gpu")
    wait_metric(decode, "kvmesh_kv_cache_free_blocks", total, tier="gpu")


def _safe(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return e


def test_a_draining_decode_engine_takes_no_new_transfers(prefill):
    d = ServerProcess("--role", "decode", "--num-threads", "1", "--num-kv-blocks", "64").start()
    try:
        assert stage1(prefill, d, "before", _body()).status_code == 200
        port = transfer_port(d)
        assert httpx.post(d.url("/admin/drain"), timeout=10).status_code == 202
        r = stage1(prefill, d, "during", _body(), port=port)
        assert r.status_code == 503 and r.json()["error"]["code"] == "decode_no_room"
    finally:
        d.stop()


def _decode_layout(d: ServerProcess):
    """The decode engine's wire layout, from its /kv/info and the default model's shape."""
    from kvmesh.engine.model.loader import load_model
    from kvmesh.engine.transfer.header import kv_layout

    info = httpx.get(d.url("/kv/info"), timeout=10).json()
    cfg = load_model("default").config
    return info, kv_layout(bytes.fromhex(info["extra_key"]), info["dtype"], info["block_size"],
                           cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)


def test_malformed_transfer_messages_are_refused_and_the_engine_serves_on(decode):
    """A Reserve whose prompt holds -1 (msgspec's list[int] takes it) once killed the decode
    engine's step thread, failing every request on it; a final push whose first token lies outside
    the vocabulary would have crashed the forward pass after the claim. Both are refused at the
    door with the field named, on a connection that stays usable, and the engine serves on."""
    from kvmesh.engine.block_hash import hash_blocks
    from kvmesh.engine.transfer import protocol
    from kvmesh.engine.transfer.client import AsyncKVClient
    from kvmesh.engine.transfer.errors import RemoteError
    from kvmesh.engine.transfer.loop_thread import shared_loop

    info, layout = _decode_layout(decode)
    loop = shared_loop()
    client = AsyncKVClient("127.0.0.1", transfer_port(decode), timeout=30)
    prompt = list(range(100, 140))  # 40 tokens: two full blocks and a partial one
    try:
        for bad_prompt, max_tokens, field in (([5, -1, 7], 4, "prompt_token_ids"),
                                              ([5, 10**9, 7], 4, "prompt_token_ids"),
                                              ([], 4, "prompt_token_ids"),
                                              ([5, 6], 0, "max_tokens"),
                                              ([5, 6], 10**9, "max_tokens")):
            reply = loop.call(client.reserve("bad", layout, bad_prompt, max_tokens), 60)
            assert isinstance(reply, protocol.ErrorReply), reply
            assert reply.kind == protocol.ERR_BAD_REQUEST and reply.field == field, reply
        r = loop.call(client.reserve("good", layout, prompt, 4), 60)
        assert isinstance(r, protocol.Reserved), r
        bs = info["block_size"]
        hashes = [*hash_blocks(prompt, bs, bytes.fromhex(info["extra_key"])), None][r.hit_blocks:]
        payloads = [bytes(layout.nbytes) for _ in hashes]
        for first, field in ((protocol.FirstToken(-1), "first.token_id"),
                             (protocol.FirstToken(10**9), "first.token_id"),
                             (protocol.FirstToken(5, generator_state=b"\0" * 16), "first.generator_state")):
            push = protocol.PushKV("good", r.hit_blocks, hashes, True, first)
            try:
                loop.call(client.push(push, payloads), 60)
            except RemoteError as e:
                assert field in str(e), e
            else:
                raise AssertionError(f"a push with a bad {field} was accepted")
        loop.call(client.cancel("good"), 60)
    finally:
        loop.call(client.aclose(), 30)
    assert httpx.get(decode.url("/ready"), timeout=10).status_code == 200
    r = httpx.post(decode.url("/v1/chat/completions"), json=_body(max_tokens=4), timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    wait_metric(decode, "kvmesh_kv_transfers_reserved", 0)


def test_handoffs_into_a_decode_engine_with_a_host_tier_keep_its_cache_exact(prefill):
    """Issue seen end to end: with a tiny primary pool and a host tier, handoffs landing on an idle
    decode engine evicted cached blocks whose host copy was still queued and then overwrote them
    with the pushed KV; the same chats sent straight to the decode engine afterwards reloaded the
    wrong bytes (6 of 8 exact). Reference: the prefill engine answering each chat by itself."""
    d = ServerProcess("--role", "decode", "--num-threads", "1", "--num-kv-blocks", "12",
                      "--cpu-kv-bytes", "256MiB").start()
    try:
        # Long enough that the 12-block pool evicts each chat before the next, and free of greedy
        # near-ties between a fully computed and a prefix-cached prompt (fp32 sums differ in order).
        chats = [_body(f"Numbers: {', '.join(str(i * 7 + k) for k in range(24))}. Write one short sentence "
                       f"about the number {i * 7 + 3}.", max_tokens=8) for i in range(8)]
        want = []
        for body in chats:
            r = httpx.post(prefill.url("/v1/chat/completions"), json=body, timeout=120)
            assert r.status_code == 200, r.text
            want.append(r.json()["choices"][0]["message"]["content"])
        for i, body in enumerate(chats):
            assert stage1(prefill, d, f"tier-{i}", body).status_code == 200
            r = stage2(d, f"tier-{i}", body)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want[i], i
        got = [httpx.post(d.url("/v1/chat/completions"), json=body, timeout=120).json()["choices"][0]["message"]
               ["content"] for body in chats]
        assert d.metric("kvmesh_kv_tier_promotions_total", tier="cpu") > 0  # the tier was read back
        assert got == want
    finally:
        d.stop()


def test_a_refused_handoff_leaves_the_others_alone_and_long_prefills_keep_their_reservation(prefill):
    """Two long prompts stream to one decode engine whose transfer timeout (2 s) is shorter than
    their prefill (16 tokens a step, over 3 s each): each accepted push extends its reservation. One of them is
    cancelled on the decode side mid-stream (as an expiry would): its next push is refused, the
    prefill side answers 502 decode_refused, and the other handoff, on the same pooled link,
    finishes and decodes. Before: the refusal closed every connection to that decode engine,
    which then freed every reservation those connections had made."""
    from kvmesh.engine.transfer.client import AsyncKVClient
    from kvmesh.engine.transfer.loop_thread import shared_loop

    p = ServerProcess("--role", "prefill", "--num-threads", "1", "--num-kv-blocks", "512",
                      "--max-num-batched-tokens", "16").start()
    d = ServerProcess("--role", "decode", "--num-threads", "1", "--num-kv-blocks", "320",
                      "--kv-transfer-timeout", "2").start()
    try:
        bodies = {tid: _body(" ".join(f"{tid} w{i % 97} {i}." for i in range(250)), 8) for tid in ("a", "b")}
        results: dict[str, object] = {}
        threads = [threading.Thread(target=lambda t=t: results.__setitem__(t, _safe(
            lambda: stage1(p, d, f"long-{t}", bodies[t], timeout=300)))) for t in bodies]
        # b queues behind a (chunked prefill serves the first prompt first) and starts once a fails.
        for n, t in enumerate(threads, start=1):
            t.start()
            wait_metric(d, "kvmesh_kv_transfers_reserved", n, timeout=60)
        loop = shared_loop()
        client = AsyncKVClient("127.0.0.1", transfer_port(d), timeout=30)
        try:
            loop.call(client.cancel("long-a"), 30)
        finally:
            loop.call(client.aclose(), 30)
        for t in threads:
            t.join(300)
        a, b = results["a"], results["b"]
        assert isinstance(a, httpx.Response) and a.status_code == 502, a
        assert a.json()["error"]["code"] == "decode_refused", a.text
        assert isinstance(b, httpx.Response) and b.status_code == 200, getattr(b, "text", b)
        done = stage2(d, "long-b", bodies["b"])
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 8
        assert p.metric("kvmesh_kv_handoffs_total", outcome="decode_refused") == 1
        nothing_held(p, d)
    finally:
        p.stop()
        d.stop()


def test_engines_told_loopback_listen_there_only(prefill, decode):
    """HTTP and UCX (the decode engine's KV listener, UCX's TCP transport in both, which the
    handoffs above started) bind --host."""
    for server in (prefill, decode):
        sockets = listening_sockets(server.proc.pid)
        assert server.port in {port for _, port in sockets}
        assert {addr for addr, _ in sockets} == {"127.0.0.1"}, server.log_tail()
    assert transfer_port(decode) in {port for _, port in listening_sockets(decode.proc.pid)}
