"""A pick's response followed on a second (observability-mode) ext_proc stream.

Real: ``PickerStream`` and ``ObserverStream`` over a real ``RouterApp`` (dispatcher, policy, ``Lease``
accounting, metrics), ``PendingPicks`` with its real timers on a real event loop, Envoy's own ext_proc
protobuf messages. Fake: the tokenizer and the engines (as in test_extproc_stream.py: nothing is
contacted). Envoy wiring the two filters is in test_extproc_envoy.py.
"""

from __future__ import annotations

import asyncio

import hypothesis.strategies as st
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hypothesis import HealthCheck, given, settings

from kvmesh.engine.router import epp
from kvmesh.engine.router.extproc_observe import ObserverStream, PendingPicks
from kvmesh.engine.router.extproc_stream import PickerStream
from tests.support.extproc_messages import (POST, URLS, body_msg, chat_body, headers_msg, load, make_app, message,
                                            response_body, response_headers)


def observer_headers(pick_id: str | None) -> pb.ProcessingRequest:
    hs = {**POST, **({epp.PICK_ID: pick_id} if pick_id is not None else {})}
    hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in hs.items()])
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hm), observability_mode=True)


def pick_id_of(resp: pb.ProcessingResponse) -> str:
    common = getattr(resp, resp.WhichOneof("response")).response
    (h,) = [h.header for h in common.header_mutation.set_headers if h.header.key == epp.PICK_ID]
    return h.raw_value.decode()


async def picked(app, picks: PendingPicks) -> tuple[PickerStream, str]:
    s = PickerStream(app, picks=picks)
    out = []
    for m in (headers_msg(POST, mode=epp.BODY_BUFFERED), body_msg(chat_body("hello there"))):
        out += await s.handle(m)
    return s, pick_id_of(out[-1])


def outcomes(app, url: str) -> dict[str, float]:
    return {o: app.metrics.requests.labels("cache-aware", url, o)._value.get() for o in ("ok", "aborted")}


def test_the_observer_claims_the_pick_by_its_id_and_the_response_releases_the_engine():
    app = make_app()

    async def go() -> None:
        picks = PendingPicks()
        s, pick_id = await picked(app, picks)
        assert len(pick_id) == 32 and len(picks) == 1
        s.close(clean=True)  # Envoy ends the pick's stream once the request side is done
        assert sum(i for i, _ in load(app).values()) == 1  # still held: the response is to come
        obs = ObserverStream(picks)
        obs.handle(observer_headers(pick_id))
        assert obs.target is s and s.observed and len(picks) == 0
        obs.handle(response_headers(served=s.session.address))
        obs.handle(response_body(b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n', False))
        assert load(app)[s.session.url] == (1, 0)  # the first token ended the queued prefill
        obs.handle(response_body(b"data: [DONE]\n\n", True))
        assert load(app) == {URLS[0]: (0, 0), URLS[1]: (0, 0)}
        obs.close()  # after the end: nothing more to release
        assert outcomes(app, s.session.url) == {"ok": 1, "aborted": 0}

    asyncio.run(go())


def test_an_observer_stream_that_dies_mid_response_aborts_the_request():
    app = make_app()

    async def go() -> None:
        picks = PendingPicks()
        s, pick_id = await picked(app, picks)
        obs = ObserverStream(picks)
        obs.handle(observer_headers(pick_id))
        s.close(clean=True)
        obs.handle(response_headers())
        obs.close()
        assert load(app) == {URLS[0]: (0, 0), URLS[1]: (0, 0)}
        assert outcomes(app, s.session.url) == {"ok": 0, "aborted": 1}

    asyncio.run(go())


def test_an_unclaimed_pick_is_released_after_the_orphan_ttl_and_a_cancelled_one_at_once():
    app = make_app()

    async def go() -> None:
        picks = PendingPicks(orphan_ttl_s=0.05)
        s, pick_id = await picked(app, picks)
        s.close(clean=True)
        assert sum(i for i, _ in load(app).values()) == 1
        await asyncio.sleep(0.2)
        assert load(app) == {URLS[0]: (0, 0), URLS[1]: (0, 0)} and len(picks) == 0
        late = ObserverStream(picks)
        late.handle(observer_headers(pick_id))  # too late: the id is gone
        assert late.target is None
        s2, _ = await picked(app, picks)
        s2.close()  # cancelled (client gone before any response): released now
        assert load(app) == {URLS[0]: (0, 0), URLS[1]: (0, 0)} and len(picks) == 0

    asyncio.run(go())


def test_ids_the_picker_did_not_mint_claim_nothing():
    app = make_app()

    async def go() -> None:
        picks = PendingPicks()
        s, pick_id = await picked(app, picks)
        for forged in ("", "0" * 32, pick_id[:-1] + ("0" if pick_id[-1] != "0" else "1"), None):
            obs = ObserverStream(picks)
            obs.handle(observer_headers(forged))
            assert obs.target is None
            obs.handle(response_body(b"data: [DONE]\n\n", True))
            obs.close()
        assert sum(i for i, _ in load(app).values()) == 1 and len(picks) == 1  # the real pick untouched
        s.close()

    asyncio.run(go())


def test_a_gateway_that_sends_the_response_on_the_pick_stream_still_works_with_the_registry():
    """GIE's single-filter wiring: the response arrives on the pick's stream; the registry entry
    goes when the response ends, and the stream's close after that releases nothing twice."""
    app = make_app()

    async def go() -> None:
        picks = PendingPicks()
        s, _ = await picked(app, picks)
        await s.handle(response_headers(ctype="application/json"))
        await s.handle(response_body(b'{"usage": {"prompt_tokens": 3}}', True))
        s.close(clean=True)
        assert load(app) == {URLS[0]: (0, 0), URLS[1]: (0, 0)} and len(picks) == 0
        assert outcomes(app, s.session.url) == {"ok": 1, "aborted": 0}

    asyncio.run(go())


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(message(), max_size=6), st.lists(message(), max_size=6), st.booleans(), st.booleans())
def test_fuzz_split_streams_never_raise_and_never_leak(pick_msgs, observer_msgs, clean, claim):
    """Any messages on the pick stream and on an observer stream (claiming the pick or not), the
    pick stream ending cleanly or cancelled: once both ended and the orphan timer ran, no load is
    left and no id is held."""
    app = make_app()

    async def go() -> None:
        picks = PendingPicks(orphan_ttl_s=0.01)
        s = PickerStream(app, picks=picks)
        for m in [headers_msg(POST, mode=epp.BODY_BUFFERED), body_msg(chat_body("x")), *pick_msgs]:
            await s.handle(m)
        obs = ObserverStream(picks)
        obs.handle(observer_headers(s.pick_id if claim else "nope"))
        for m in observer_msgs:
            obs.handle(m)
        s.close(clean)
        obs.close()
        await asyncio.sleep(0.03)
        assert len(picks) == 0

    asyncio.run(go())
    assert all(v == (0, 0) for v in load(app).values()), load(app)
