"""The router's side of the compiled ext_proc front: frames over its Unix socket, and fuzzed.

Real: ``FrontSocket`` on a real Unix socket over a real ``RouterApp`` (dispatcher, policy, ``Lease``
accounting, metrics), the frame codec both ways. Fake: the front (this test writes the frames the
Go front writes; the Go front itself meets this socket in test_extproc_envoy.py, behind a real
Envoy), the tokenizer and the engines (two engine states marked healthy by hand).
"""

from __future__ import annotations

import asyncio
import base64
import json
import tempfile
from pathlib import Path

import hypothesis.strategies as st
from hypothesis import HealthCheck, given, settings

from kvmesh.engine.router import epp
from kvmesh.engine.router.front_socket import Answer, FrontFrame, FrontSocket, frame_bytes
from tests.support.extproc_messages import ADDRS, LIMIT, POST, chat_body, load, make_app


class Front:
    """A client speaking the front's side of the protocol."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def tell(self, **fields) -> None:
        self.writer.write(frame_bytes(FrontFrame(**fields)))

    async def read(self) -> dict:
        n = int.from_bytes(await self.reader.readexactly(4), "big")
        return json.loads(await self.reader.readexactly(n))

    async def answer(self) -> dict:
        """The next answer that is not a readiness push."""
        while (msg := await self.read())["t"] == "ready":
            pass
        return msg

    async def pick(self, request_id: int, body: bytes = b"", **fields) -> dict:
        self.tell(t="pick", id=request_id, headers=POST, body=body, mode=epp.BODY_BUFFERED, **fields)
        got = await self.answer()
        assert got["id"] == request_id
        return got


async def with_socket(test, app=None) -> None:
    app = app or make_app()
    with tempfile.TemporaryDirectory() as d:
        sock = FrontSocket(app, str(Path(d) / "pick.sock"))
        await sock.start()
        try:
            reader, writer = await asyncio.open_unix_connection(sock.path)
            try:
                await test(app, sock, Front(reader, writer))
            finally:
                writer.close()
        finally:
            await sock.stop()


async def released(app) -> None:
    """Wait (up to 1 s) for every engine's load to drop to nothing, then check it did."""
    for _ in range(100):
        if all(v == (0, 0) for v in load(app).values()):
            break
        await asyncio.sleep(0.01)
    assert all(v == (0, 0) for v in load(app).values()), load(app)


def run(test, app=None) -> None:
    asyncio.run(with_socket(test, app))


def test_a_pick_routes_and_the_response_end_releases_the_engine():
    async def test(app, sock, front):
        assert (await front.read()) == {"t": "ready", "ready": app.ready()}  # pushed on connect
        got = await front.pick(1, chat_body("hello"))
        assert got["t"] == "route" and got["address"] in ADDRS and not got.get("changed")
        assert sum(i for i, _ in load(app).values()) == 1
        front.tell(t="resp", id=1, status=200, content_type="text/event-stream", served=got["address"])
        front.tell(t="chunk", id=1, body=b'data: {"choices":[{"text":"x"}]}\n\n')
        front.tell(t="chunk", id=1, body=b"data: [DONE]\n\n", eos=True)
        await asyncio.sleep(0.05)
        assert load(app) == {u: (0, 0) for u in load(app)}
        url = next(u for u in load(app) if epp.endpoint_address(u) == got["address"])
        assert app.metrics.requests.labels("cache-aware", url, "ok")._value.get() == 1

    run(test)


def test_the_front_going_away_abandons_what_its_requests_held():
    async def test(app, sock, front):
        await front.pick(1, chat_body("one"))
        await front.pick(2, chat_body("two"))
        assert sum(i for i, _ in load(app).values()) == 2
        front.writer.close()
        await released(app)

    run(test)


def test_an_end_during_the_pick_releases_the_engine_once_picked():
    async def test(app, sock, front):
        front.tell(t="pick", id=7, headers=POST, body=chat_body("racing"), mode=epp.BODY_BUFFERED)
        front.tell(t="end", id=7, outcome="aborted")
        await asyncio.sleep(0.05)
        assert all(v == (0, 0) for v in load(app).values())

    run(test)


def test_refusals_are_the_routers_errors_in_openai_format():
    async def test(app, sock, front):
        cases = [(dict(body=b"{oops"), 400, "not valid JSON"),
                 (dict(body=chat_body("x"), too_large=LIMIT + 1), 413, "request_too_large"),
                 (dict(body=chat_body("x"), mode=epp.BODY_STREAMED), 500, "STREAMED"),
                 (dict(body=chat_body("x"), problem="empty_message"), 400, "empty ext_proc message"),
                 (dict(body=chat_body("x"), subset={"a": 1}), 400, "struct_value"),
                 (dict(body=chat_body("x"), subset=["10.9.9.9:1"]), 503, "candidates")]
        for i, (fields, status, words) in enumerate(cases, 1):
            fields.setdefault("mode", epp.BODY_BUFFERED)
            front.tell(t="pick", id=i, headers=POST, **fields)
            got = await front.answer()
            assert (got["t"], got["id"], got["status"]) == ("refuse", i, status), got
            text = base64.b64decode(got["body"]).decode()
            assert words in text and "error" in json.loads(text), text
            assert ["content-type", "application/json"] in got["headers"]
        assert all(v == (0, 0) for v in load(app).values())

    run(test)


def test_the_subset_hint_restricts_the_pick():
    async def test(app, sock, front):
        for i in range(4):
            assert (await front.pick(i + 1, chat_body(f"q{i}"), subset=[ADDRS[1]]))["address"] == ADDRS[1]
            assert (await front.pick(i + 11, chat_body(f"r{i}"), subset=ADDRS[0]))["address"] == ADDRS[0]

    run(test)


def test_a_malformed_frame_drops_that_connection_only():
    async def test(app, sock, front):
        await front.pick(1, chat_body("held"))
        front.writer.write((5).to_bytes(4, "big") + b"nope!")
        await asyncio.wait_for(front.reader.read(), 5)  # returns at EOF: the router closed it
        reader, writer = await asyncio.open_unix_connection(sock.path)
        try:
            again = Front(reader, writer)
            assert (await again.pick(2, chat_body("again")))["t"] == "route"
        finally:
            writer.close()
        assert sum(i for i, _ in load(app).values()) == 1  # the dropped connection's request was released

    run(test)


_frame = st.fixed_dictionaries({"t": st.sampled_from(["pick", "pick", "resp", "chunk", "end", "bogus"]),
                                "id": st.integers(0, 2)},
                               optional={"headers": st.dictionaries(st.sampled_from([":method", ":path", "x"]),
                                                                    st.text(max_size=20), max_size=3),
                                         "body": st.sampled_from(["", "e30=", "eyJtb2RlbCI6Im0ifQ==", "!!"]),
                                         "subset": st.one_of(st.none(), st.text(max_size=10), st.lists(st.text())),
                                         "mode": st.integers(-1, 9), "too_large": st.integers(-5, LIMIT * 2),
                                         "status": st.integers(-1, 600), "eos": st.booleans(),
                                         "outcome": st.text(max_size=8), "problem": st.text(max_size=8)})


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(_frame.map(lambda d: json.dumps(d).encode()), st.binary(max_size=40)), max_size=8))
def test_fuzzed_frames_never_break_the_socket_and_leave_no_load_behind(payloads):
    """Whatever arrives (valid, invalid, garbage), the router keeps serving new connections and,
    once the sender is gone, holds no load for it."""

    async def test(app, sock, front):
        for p in payloads:
            front.writer.write(len(p).to_bytes(4, "big") + p)
        await asyncio.sleep(0.02)
        front.writer.close()
        reader, writer = await asyncio.open_unix_connection(sock.path)
        try:
            assert (await Front(reader, writer).pick(99, chat_body("still here")))["t"] == "route"
        finally:
            writer.close()
        await released(app)

    run(test)


def test_answer_and_frame_fields_match_the_go_fronts_declarations():
    """The Go front (engine/router/front/router.go) declares the same JSON names as these structs."""
    go = (Path(epp.__file__).parent / "front" / "router.go").read_text()
    for struct in (FrontFrame, Answer):
        for name in struct.__struct_fields__:
            assert f'`json:"{name}' in go, f"{struct.__name__}.{name} is not in router.go"


def test_without_go_or_a_built_front_auto_serves_from_python_and_compiled_refuses(tmp_path, monkeypatch):
    """Real: the lookup and the build step (no Go on PATH, an empty cache); the servers are not started."""
    import dataclasses

    import pytest

    from kvmesh.engine.router.extproc import ExtProcServer
    from kvmesh.engine.router.front_proc import FrontUnavailable, ext_proc_server

    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    app = make_app()
    app.settings = dataclasses.replace(app.settings, ext_proc_port=0)
    assert isinstance(asyncio.run(ext_proc_server(app)), ExtProcServer)
    assert app.metrics.ext_proc.labels("python")._value.get() == 1
    app.settings = dataclasses.replace(app.settings, ext_proc_front="compiled")
    with pytest.raises(FrontUnavailable, match="no Go toolchain"):
        asyncio.run(ext_proc_server(app))
