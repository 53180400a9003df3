"""The router's end-to-end TTFT/TPOT clock (engine/router/slo.py) as pure functions over the
bytes the engines really send (their own response builders), and its two histograms."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.engine.router import proxy
from kvmesh.engine.router.metrics import RouterMetrics
from kvmesh.engine.router.slo import ClientClock, completion_tokens_in, only_tokens, token_events
from kvmesh.engine.server import responses as r
from kvmesh.engine.util.metrics import (
    REQUEST_LATENCY_BUCKETS,
    ROUTER_TPOT,
    ROUTER_TTFT,
    TOKEN_LATENCY_BUCKETS,
    parse_samples,
    render,
    sample_value,
)

SSE = [(b"content-type", b"text/event-stream")]
JSON = [(b"content-type", b"application/json")]


def chat(index: int, delta: dict, reason: str | None = None) -> bytes:
    return r.sse(r.chat_chunk("id", 1, "m", index, delta, reason))


ROLE = chat(0, {"role": "assistant", "content": ""})
USAGE = r.sse(r.usage_chunk("id", 1, "m", "chat.completion.chunk", r.usage(5, 7, 0)))


def test_token_events_leave_out_the_events_that_carry_no_token():
    assert token_events(ROLE) == 0
    assert token_events(chat(0, {"content": "Hi"})) == 1
    assert token_events(ROLE + chat(0, {"content": "Hi"})) == 1  # head and first token in one read
    assert token_events(chat(0, {"content": "a"}) + chat(0, {"content": "b"}, "stop")) == 2
    assert token_events(USAGE + r.SSE_DONE) == 0
    assert token_events(r.SSE_DONE) == 0
    assert token_events(proxy.sse_error(proxy.all_engines_down([]))) == 0
    assert token_events(b'data: {"choices":[{"text":"ab') == 0  # incomplete: counts when completed
    # Generated text that spells the markers is JSON-escaped, so it is still a token.
    tricky = chat(0, {"content": '"role" "choices":[] {"error": data: [DONE]\n\n'})
    assert token_events(tricky) == 1


def test_completion_tokens_come_from_the_usage_only_event():
    assert completion_tokens_in(chat(0, {"content": "x"}) + USAGE + r.SSE_DONE) == 7
    assert completion_tokens_in(chat(0, {"content": "x"})) is None
    assert completion_tokens_in(b'data: {"choices":[],"usage":{}}\n\n') is None


def feed(clock: ClientClock, messages: list[tuple[float, dict]]) -> ClientClock:
    for now, msg in messages:
        clock.on_message(msg, now)
    return clock


def start(headers, status=200):
    return {"type": "http.response.start", "status": status, "headers": headers}


def body(data: bytes, more: bool = True):
    return {"type": "http.response.body", "body": data, "more_body": more}


def test_a_streamed_chat_times_its_first_token_event_not_the_role_head():
    c = feed(ClientClock(received=10.0), [
        (10.5, start(SSE)), (10.5, body(ROLE)),  # what the upstream first byte would time
        (11.0, body(chat(0, {"content": "a"}))), (11.2, body(chat(0, {"content": "b"}))),
        (11.4, body(chat(0, {"content": "c"}, "stop"))), (11.4, body(r.SSE_DONE)), (11.4, body(b"", more=False))])
    assert c.ttft_s() == pytest.approx(1.0)
    assert c.tpot_s() == pytest.approx(0.2)  # 3 token events over 0.4 s


def test_a_stream_is_timed_once_its_done_event_went_out_though_the_client_hung_up_after_it():
    # The openai client closes on [DONE]; the router then cancels the request before the ASGI
    # closing message, so the stream must count as ended at [DONE].
    c = feed(ClientClock(received=0.0), [
        (0.1, start(SSE)), (0.2, body(chat(0, {"content": "a"}))), (0.4, body(chat(0, {"content": "b"}, "stop"))),
        (0.4, body(r.SSE_DONE))])
    assert c.tpot_s() == pytest.approx(0.2)


def test_tpot_divides_by_the_usage_count_when_the_stream_has_one():
    c = feed(ClientClock(received=0.0), [
        (0.1, start(SSE)), (0.1, body(chat(0, {"content": "ab"}))), (0.7, body(chat(0, {"content": "cdefg"}))),
        (0.7, body(USAGE + r.SSE_DONE)), (0.7, body(b"", more=False))])
    assert c.events == 2 and c.usage_tokens == 7
    assert c.tpot_s() == pytest.approx(0.1)  # 0.6 s / (7 - 1)


def test_no_tpot_for_one_token_an_unfinished_stream_or_an_error_event():
    one = feed(ClientClock(0.0), [(0.1, start(SSE)), (0.2, body(chat(0, {"content": "a"}, "stop"))),
                                  (0.2, body(b"", more=False))])
    assert one.ttft_s() == pytest.approx(0.2) and one.tpot_s() is None
    left = feed(ClientClock(0.0), [(0.1, start(SSE)), (0.2, body(chat(0, {"content": "a"}))),
                                   (0.3, body(chat(0, {"content": "b"})))])
    assert left.ttft_s() == pytest.approx(0.2) and left.tpot_s() is None  # the client went away
    broke = feed(ClientClock(0.0), [(0.1, start(SSE)), (0.2, body(chat(0, {"content": "a"}))),
                                    (0.3, body(chat(0, {"content": "b"}))),
                                    (0.4, body(proxy.sse_error(proxy.all_engines_down([])), more=False))])
    assert broke.ttft_s() == pytest.approx(0.2) and broke.tpot_s() is None


def test_a_body_that_is_not_streamed_is_its_own_first_token_and_has_no_tpot():
    c = feed(ClientClock(1.0), [(3.0, start(JSON)), (3.5, body(b'{"choices":[]}', more=False))])
    assert not c.stream and c.ttft_s() == pytest.approx(2.5) and c.tpot_s() is None


def test_only_200_responses_are_timed():
    c = feed(ClientClock(0.0), [(0.1, start(JSON, 503)), (0.1, body(b'{"error":{}}', more=False))])
    assert c.ttft_s() is None and c.tpot_s() is None
    empty = feed(ClientClock(0.0), [(0.1, start(SSE)), (0.2, body(ROLE)), (0.3, body(r.SSE_DONE, more=False))])
    assert empty.ttft_s() is None  # no token ever reached the client


def test_wrap_feeds_the_clock_and_passes_every_message_through():
    sent = []

    async def inner(msg):
        sent.append(msg)

    async def run():
        clock = ClientClock(0.0)
        send = clock.wrap(inner)
        for m in (start(SSE), body(chat(0, {"content": "a"})), body(b"", more=False)):
            await send(m)
        return clock

    clock = asyncio.run(run())
    assert len(sent) == 3 and clock.ended and clock.events == 1 and clock.first is not None


def test_metrics_observe_ttft_by_stream_and_tpot_with_the_engines_buckets():
    m = RouterMetrics("round-robin", lambda: 0, dict)
    streamed = feed(ClientClock(0.0), [(0.0, start(SSE)), (0.3, body(chat(0, {"content": "a"}))),
                                       (0.5, body(chat(0, {"content": "b"}))), (0.5, body(b"", more=False))])
    whole = feed(ClientClock(0.0), [(2.0, start(JSON)), (2.0, body(b"{}", more=False))])
    for c in (streamed, whole, ClientClock(0.0)):
        m.observe_client(c)
    s = parse_samples(render(m.registry)[0].decode())
    assert sample_value(s, ROUTER_TTFT + "_count", stream="true") == 1
    assert sample_value(s, ROUTER_TTFT + "_sum", stream="true") == pytest.approx(0.3)
    assert sample_value(s, ROUTER_TTFT + "_count", stream="false") == 1
    assert sample_value(s, ROUTER_TPOT + "_count") == 1
    assert sample_value(s, ROUTER_TPOT + "_sum") == pytest.approx(0.2)
    les = {float(dict(ls)["le"]) for (n, ls) in s if n == ROUTER_TTFT + "_bucket"}
    assert les == set(REQUEST_LATENCY_BUCKETS) | {float("inf")}
    les = {float(dict(ls)["le"]) for (n, ls) in s if n == ROUTER_TPOT + "_bucket"}
    assert les == set(TOKEN_LATENCY_BUCKETS) | {float("inf")}


def test_the_one_scan_path_agrees_with_the_full_count():
    token = chat(0, {"content": "a"})
    for chunk in (token, token * 3, chat(0, {"content": "b"}, "stop"),
                  r.sse(r.completion_chunk("id", 1, "m", r.completion_choice(0, "x", None, None)))):
        assert only_tokens(chunk) and token_events(chunk) == chunk.count(b"\n\n")
    for chunk in (USAGE, token + USAGE, token + r.SSE_DONE, proxy.sse_error(proxy.all_engines_down([])),
                  b'data: {"usage":{},"choices":[]}\n\n', token[:-3]):
        assert not only_tokens(chunk)
    # Each kind of chunk after the first token, through the clock: the same counts either way.
    c = feed(ClientClock(0.0), [(0.0, start(SSE)), (0.1, body(ROLE + token)), (0.2, body(token * 2)),
                                (0.3, body(token + USAGE)), (0.3, body(r.SSE_DONE)), (0.3, body(b"", more=False))])
    assert (c.events, c.usage_tokens, c.first, c.last) == (4, 7, 0.1, 0.3)
