"""Prefill/decode disaggregation on the router: every request in two stages (docs/disagg.md).

Stage 1 POSTs the client's body plus ``kv_transfer_params{transfer_id, decode_host,
decode_port}`` to a prefill engine (picked by the router's policy over the prefill pool and its
own prefix index); that engine computes the prompt and pushes the KV and the first token to the
decode engine the router picked (by ``build_decode_policy`` over the decode pool). Stage 2 POSTs
the body plus ``kv_transfer_params{transfer_id}`` to that decode engine and relays its answer
with ``proxy.attempt``. Nothing reaches the client before stage 2's first byte, so every retry
below stays invisible to it.

What each stage-1 answer leads to (every new attempt gets a fresh transfer id):

- ``decode_no_room``: skip that decode engine for now; once every decode engine has refused,
  wait with backoff and offer the request to them again, for at most ``pd_queue_timeout_s``
  and with at most ``pd_max_queued`` requests waiting router-wide; past either, 503
  ``no_decode_capacity`` with Retry-After.
- ``decode_unreachable`` / ``decode_failed``, or stage 2 lost before its first byte, or 409
  ``transfer_not_found``: that decode engine is skipped (and taken out when it is down) and the
  request starts over at stage 1; at most ``max_attempts`` such decode failures per request.
- a prefill engine that cannot take it (connection error, 5xx, 429): another prefill engine,
  at most ``max_attempts``. With none left the request is served plain by a decode engine
  (which prefills it itself), unless the prefill engines were only busy: their 429 is relayed.
- any other answer (400: an invalid request, or a prompt larger than a decode engine's KV) is
  relayed to the client as is.

Requests with ``n > 1`` or several prompts go to a decode engine as plain requests (one
transfer names one sequence); so do all requests while no prefill engine is healthy.

The decisions (decode-pool policy, body preparation, stage-1 classification, backoff) are pure
functions tested directly; ``TwoStageRouter`` only sequences them with I/O.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import aiohttp
import msgspec

from kvmesh.engine.router import proxy
from kvmesh.engine.router.discovery import EngineState
from kvmesh.engine.router.policies import (
    Endpoint,
    LoadModel,
    Policy,
    RouteRequest,
    healthy_filter,
    load_cap_filter,
    load_scorer,
    not_draining_filter,
    prefix_scorer,
)
from kvmesh.engine.router.prompt import COMPLETIONS, PromptInfo
from kvmesh.engine.api.errors import APIError

if TYPE_CHECKING:
    from kvmesh.engine.router.dispatch import Dispatcher
    from kvmesh.engine.router.metrics import PDMetrics

KV_TRANSFER_PARAMS = "kv_transfer_params"
TRANSFER_NOT_FOUND = "transfer_not_found"
DECODE_NO_ROOM = "decode_no_room"
DECODE_FAILED_CODES = frozenset({"decode_unreachable", "decode_failed"})

# Stage-1 outcomes (also the values of kvmesh_router_pd_stage1_total{outcome}).
OK = "ok"
NO_ROOM = "decode_no_room"
DECODE_FAILED = "decode_failed"
DECODE_REFUSED = "decode_refused"  # the decode engine answered (up and serving) but dropped this transfer
PREFILL_FAILED = "prefill_failed"
RELAY = "relayed"
STAGE1_OUTCOMES = (OK, NO_ROOM, DECODE_FAILED, DECODE_REFUSED, PREFILL_FAILED, RELAY)

# Why a request is served plain by a decode engine (kvmesh_router_pd_fallback_total{reason}).
FALLBACK_REASONS = ("no_prefill", "prefill_failed", "n_gt_1", "multi_prompt", "prompt_logprobs", "unparsed",
                    "decode_not_receiving")

STAGE2_RETRY_STATUSES = proxy.RETRY_STATUSES | {409}
"""Stage-2 answers that start the request over instead of reaching the client (409 only with
``transfer_not_found``; any other 409 is relayed)."""

BACKOFF_FIRST_S = 0.05
BACKOFF_MAX_S = 1.0

_decoder = msgspec.json.Decoder()
_encode = msgspec.json.Encoder().encode


# ---- the decode-pool policy (pure) -----------------------------------------------------------
def needed_blocks(prompt_tokens: int, block_size: int, hit_blocks: int) -> int:
    """KV blocks a decode engine must reserve for a transfer: the prompt plus the first
    generated token, less the leading blocks it already holds (at least one block)."""
    return max(1, math.ceil((prompt_tokens + 1) / block_size) - hit_blocks)


def room_filter(req: RouteRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
    """Decode engines whose last reported free blocks hold this request; all when none does.

    The report is up to a probe interval old, and the engine's own reservation is what decides
    (it answers ``decode_no_room`` at once), so this only steers: it never refuses by itself.
    An engine that reports no free-block count is kept.
    """

    def fits(e: Endpoint) -> bool:
        if e.free_blocks is None:
            return True
        m = req.matches.get(e.id)
        return e.free_blocks >= needed_blocks(req.prompt_tokens, req.block_size, m.blocks if m else 0)

    room = [e for e in endpoints if fits(e)]
    return room or list(endpoints)


def build_decode_policy(name: str, load: LoadModel = LoadModel(), hit_weight: float = 1.0,
                        load_weight: float = 1.0) -> Policy:
    """How a decode engine is picked for the router policy ``name``.

    round-robin stays a baseline (healthy, not draining, rotate). Every other policy: healthy,
    not draining, room for the KV, under the running cap; then the decode engine's own prefix
    hits (tokens whose KV need not be sent) against its load (requests in flight, in tokens, as
    ``policies.load_scorer`` weighs them). Session affinity applies to the prefill pick, where
    the prompt's cache is computed.
    """
    base = (healthy_filter, not_draining_filter)
    if name == "round-robin":
        return Policy("pd-decode-round-robin", base, ())
    return Policy("pd-decode", base + (room_filter, load_cap_filter(load)),
                  ((prefix_scorer, hit_weight), (load_scorer(load), load_weight)))


# ---- request bodies (pure) -------------------------------------------------------------------
@dataclass(frozen=True)
class PreparedBody:
    """The client's JSON body decoded once, re-encoded once, ready for ``kv_transfer_params``.

    ``head`` is the object without its closing brace and without any ``kv_transfer_params`` the
    client sent (the router owns that field), so each attempt's body is one concatenation.
    ``fallback`` names why the request must be served plain instead (``FALLBACK_REASONS``).
    """

    head: bytes = b""
    has_fields: bool = False
    fallback: str | None = None

    def with_params(self, params: Mapping[str, Any]) -> bytes:
        return b"".join((self.head, b"," if self.has_fields else b"", b'"' + KV_TRANSFER_PARAMS.encode() + b'":',
                         _encode(params), b"}"))


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 1


def _is_batch(prompt: Any) -> bool:
    """Several prompts (a list of strings or of token lists), not one prompt of token ids."""
    return isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt)


def prepare_body(path: str, body: bytes) -> PreparedBody:
    """``body`` ready for two-stage serving, or with ``fallback`` set when it cannot be."""
    try:
        doc = _decoder.decode(body)
    except msgspec.DecodeError:
        return PreparedBody(fallback="unparsed")  # a decode engine answers the 400
    if not isinstance(doc, dict):
        return PreparedBody(fallback="unparsed")
    if _count(doc.get("n")) > 1 or _count(doc.get("best_of")) > 1:
        return PreparedBody(fallback="n_gt_1")
    if path == COMPLETIONS and _is_batch(doc.get("prompt")):
        return PreparedBody(fallback="multi_prompt")
    if doc.get("prompt_logprobs") is not None or (doc.get("echo") is True and doc.get("logprobs") is not None):
        return PreparedBody(fallback="prompt_logprobs")  # the prompt is scored where it is computed
    doc.pop(KV_TRANSFER_PARAMS, None)
    return PreparedBody(_encode(doc)[:-1], bool(doc))


def error_code(body: bytes) -> str | None:
    """``error.code`` of an OpenAI error body, if it is one."""
    try:
        doc = _decoder.decode(body)
        code = doc["error"]["code"]
    except (msgspec.DecodeError, KeyError, TypeError):
        return None
    return code if isinstance(code, str) else None


# ---- stage 1 (classification pure) -----------------------------------------------------------
@dataclass(frozen=True)
class Stage1Answer:
    """What a prefill engine answered, as the router acts on it (``kind``: ``STAGE1_OUTCOMES``).

    ``engine_down``: the prefill engine should be taken out (refused or lost connection, 503);
    ``transfer``: the ``kv_transfer`` object of an ``ok`` answer; ``status``, ``body`` and
    ``headers``: the answer itself, relayed when ``kind`` is ``relayed`` (or a 429 at the end).
    """

    kind: str
    detail: str
    status: int = 0
    body: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    engine_down: bool = False
    transfer: dict[str, Any] | None = None


def classify_stage1(status: int, body: bytes, transfer_id: str,
                    headers: tuple[tuple[bytes, bytes], ...] = ()) -> Stage1Answer:
    """A prefill engine's answer to stage 1, per the table in docs/disagg.md."""
    if status == 200:
        try:
            doc = _decoder.decode(body)
        except msgspec.DecodeError:
            doc = None
        if isinstance(doc, dict) and doc.get("object") == "kv_transfer" and doc.get("transfer_id") == transfer_id:
            return Stage1Answer(OK, "ok", status, transfer=doc)
        return Stage1Answer(PREFILL_FAILED, "answered 200 without a kv_transfer object for this transfer: is it "
                            "running `kvmesh serve --role prefill`?", status)
    code = error_code(body)
    if status == 503 and code == DECODE_NO_ROOM:
        return Stage1Answer(NO_ROOM, "the decode engine has no room for this request", status, body, headers)
    if status == 502 and code in DECODE_FAILED_CODES:
        return Stage1Answer(DECODE_FAILED, f"transfer failed ({code})", status, body, headers)
    if status == 502 and code == DECODE_REFUSED:
        return Stage1Answer(DECODE_REFUSED, "the decode engine refused this transfer", status, body, headers)
    if status == 429 or status >= 500:
        return Stage1Answer(PREFILL_FAILED, f"prefill engine answered HTTP {status}" + (f" ({code})" if code else ""),
                            status, body, headers, engine_down=status == 503)
    return Stage1Answer(RELAY, f"HTTP {status}", status, body, headers)


async def post_stage1(session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str],
                      timeout: aiohttp.ClientTimeout, transfer_id: str) -> Stage1Answer:
    """POST stage 1 to a prefill engine and classify the answer (never raises for upstream errors).

    A 200 that is not JSON (an engine that is not a prefill engine streaming a whole answer) is
    not read: closing the connection makes that engine abort the generation.
    """
    try:
        resp = await session.post(url, data=body, headers=headers, timeout=timeout)
    except proxy.UPSTREAM_ERRORS as e:
        return Stage1Answer(PREFILL_FAILED, f"{type(e).__name__}: {e}", engine_down=True)
    complete = False
    try:
        ctype = resp.headers.get("content-type", "")
        if resp.status == 200 and not ctype.startswith("application/json"):
            return Stage1Answer(PREFILL_FAILED, f"answered 200 with {ctype or 'no content type'} instead of a "
                                "kv_transfer object: is it running `kvmesh serve --role prefill`?", 200)
        try:
            data = await resp.read()
        except proxy.UPSTREAM_ERRORS as e:
            return Stage1Answer(PREFILL_FAILED, f"{type(e).__name__}: {e}", engine_down=True)
        complete = True
        return classify_stage1(resp.status, data, transfer_id, tuple(proxy.response_headers(resp, None)))
    finally:
        if complete:
            resp.release()
        else:
            resp.close()


def backoff_s(waits: int) -> float:
    """The pause before offering a request to the decode pool again after ``waits`` rounds in
    which every decode engine refused it: 50 ms doubling up to 1 s."""
    return min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** min(waits, 16))


def no_decode_capacity(why: str) -> APIError:
    return APIError(f"no decode engine has KV room for this request: {why}. Retry shortly.", 503,
                    "service_unavailable", "no_decode_capacity", None, {"Retry-After": "1"})


# ---- the flow --------------------------------------------------------------------------------
@dataclass
class Attempts:
    """One request's retry state across both stages."""

    prefill_excluded: set[str] = field(default_factory=set)
    decode_excluded: set[str] = field(default_factory=set)  # failed, lost, or lost its transfer
    refused: set[str] = field(default_factory=set)  # answered decode_no_room since the last wait
    prefill_failures: int = 0
    decode_failures: int = 0
    tried: list[str] = field(default_factory=list)
    prefill_busy: Stage1Answer | None = None  # the last 429 from a prefill engine
    wait_started: float | None = None
    waits: int = 0


class TwoStageRouter:
    """Serves generation requests over a prefill and a decode fleet (the module doc).

    Invariant: ``queued`` counts the requests now waiting for decode capacity, each once from
    its first full refusal until it leaves (placed, rejected, failed or cancelled), and never
    exceeds ``pd_max_queued``.
    """

    def __init__(self, dispatch: Dispatcher, metrics: PDMetrics) -> None:
        self.dispatch = dispatch
        self.metrics = metrics
        self.decode_policy = build_decode_policy(dispatch.settings.policy, dispatch.settings.load)
        self.queued = 0
        self._decode_turn = itertools.count()  # ties rotate per pool, not in step with the prefill picks

    async def serve(self, info: PromptInfo, body: bytes, headers: dict[str, str], send: proxy.Send, path: str,
                    session: str | None, t0: float) -> None:
        prepared = prepare_body(path, body)
        if prepared.fallback is not None:
            await self._fallback(prepared.fallback, info, body, headers, send, path, t0, decided=False)
            return
        st = Attempts()
        try:
            await self._run(st, prepared, info, body, headers, send, path, session, t0)
        finally:
            if st.wait_started is not None:
                self.queued -= 1
                self.metrics.queue_wait.observe(time.monotonic() - st.wait_started)

    async def _run(self, st: Attempts, prepared: PreparedBody, info: PromptInfo, body: bytes,
                   headers: dict[str, str], send: proxy.Send, path: str, session: str | None, t0: float) -> None:
        d, s = self.dispatch, self.dispatch.settings
        assert d.fleet is not None and d.prefill_fleet is not None
        decided = False
        while True:
            now = time.monotonic()
            prefill_url, predicted = (None, 0) if st.prefill_failures >= s.max_attempts else d.choose(
                d.prefill_fleet, d.policy, info, session, frozenset(st.prefill_excluded), now)
            if prefill_url is None:
                if st.prefill_busy is not None:  # every prefill engine is busy: their 429 says it best
                    busy = st.prefill_busy
                    await proxy.send_json(send, 429, busy.body, [h for h in busy.headers if h[0] != b"content-type"])
                    d.metrics.count("none", "unavailable")
                    return
                reason = "prefill_failed" if st.prefill_failures else "no_prefill"
                await self._fallback(reason, info, body, headers, send, path, t0, decided)
                return
            decode_url, _ = (None, 0) if st.decode_failures >= s.max_attempts else d.choose(
                d.fleet, self.decode_policy, info, None, frozenset(st.decode_excluded | st.refused), now,
                receiving_only=True, turn=next(self._decode_turn))
            if not decided:
                d.metrics.decision.observe(time.perf_counter() - t0)
                decided = True
            if decode_url is None:
                if st.refused and st.decode_failures < s.max_attempts:
                    err = await self._wait(st)
                    if err is None:
                        st.refused.clear()
                        continue
                    await proxy.send_error(send, err)
                elif not st.tried and not any(e.transfer_port for e in d.fleet.engines.values() if e.healthy) \
                        and d.fleet.num_healthy():
                    await self._fallback("decode_not_receiving", info, body, headers, send, path, t0, decided)
                    return
                else:
                    await proxy.send_error(send, proxy.all_engines_down(st.tried))
                d.metrics.count("none", "unavailable")
                return
            if await self._attempt(st, prepared, info, headers, send, path, prefill_url, decode_url, predicted):
                return

    async def _attempt(self, st: Attempts, prepared: PreparedBody, info: PromptInfo, headers: dict[str, str],
                       send: proxy.Send, path: str, prefill_url: str, decode_url: str, predicted: int) -> bool:
        """Stage 1 then (on success) stage 2 on one (prefill, decode) pair; True when the client
        has its answer, False to go round again with ``st`` updated."""
        d = self.dispatch
        assert d.fleet is not None and d.prefill_fleet is not None
        decode = d.fleet.engines.get(decode_url)
        prefill = d.prefill_fleet.engines.get(prefill_url)
        if decode is None or decode.transfer_port is None:  # left the pool since the pick
            st.decode_excluded.add(decode_url)
            return False
        transfer_id = uuid.uuid4().hex
        params = {"transfer_id": transfer_id, "decode_host": urlsplit(decode_url).hostname,
                  "decode_port": decode.transfer_port}
        uncached = max(0, info.num_prompt_tokens - predicted)
        ans, elapsed = await self._stage1(prefill, decode, prefill_url, path, prepared.with_params(params),
                                          headers, transfer_id, uncached)
        if ans.kind == OK:
            t = ans.transfer or {}
            self.metrics.blocks_sent.inc(_non_negative(t.get("blocks_sent")))
            self.metrics.decode_hit_blocks.inc(_non_negative(t.get("decode_hit_blocks")))
            result = await d.attempt(decode, decode_url, path, prepared.with_params({"transfer_id": transfer_id}),
                                        headers, send, info, predicted, uncached=0, ttft_extra_s=elapsed,
                                        retry_statuses=STAGE2_RETRY_STATUSES)
            if isinstance(result, proxy.Done):
                return True
            if result.status == 409 and error_code(result.body) != TRANSFER_NOT_FOUND:
                await proxy.send_json(send, 409, result.body, [h for h in result.headers if h[0] != b"content-type"])
                d.metrics.count(decode_url, "client_error")
                return True
            reason = TRANSFER_NOT_FOUND if result.status == 409 else result.reason
            self.metrics.restarts.labels(reason).inc()
            st.decode_excluded.add(decode_url)
            st.decode_failures += 1
            st.tried.append(f"decode {decode_url}: {result.detail}")
            if result.engine_down:
                d.fleet.mark_failed(decode_url, result.detail)
        elif ans.kind == NO_ROOM:
            self.metrics.refusals.labels(decode_url).inc()
            st.refused.add(decode_url)
        elif ans.kind in (DECODE_FAILED, DECODE_REFUSED):
            if ans.kind == DECODE_FAILED:  # a refusal comes from a healthy engine: only this request avoids it
                d.fleet.mark_failed(decode_url, f"{ans.detail}, reported by {prefill_url}")
            st.decode_excluded.add(decode_url)
            st.decode_failures += 1
            st.tried.append(f"decode {decode_url}: {ans.detail}")
        elif ans.kind == PREFILL_FAILED:
            st.prefill_excluded.add(prefill_url)
            st.prefill_failures += 1
            st.tried.append(f"prefill {prefill_url}: {ans.detail}")
            if ans.status == 429:
                st.prefill_busy = ans
            if ans.engine_down:
                d.prefill_fleet.mark_failed(prefill_url, ans.detail)
        else:  # RELAY: the request itself is the problem; the engine's answer says why
            await proxy.send_json(send, ans.status, ans.body, [h for h in ans.headers if h[0] != b"content-type"])
            d.metrics.count(prefill_url, "client_error" if ans.status < 500 else "upstream_error")
            return True
        return False

    async def _stage1(self, prefill: EngineState | None, decode: EngineState, url: str, path: str, body: bytes,
                      headers: dict[str, str], transfer_id: str, uncached: int) -> tuple[Stage1Answer, float]:
        """Stage 1 with the load accounting it implies: the prefill engine holds ``uncached``
        prompt tokens of work and the decode engine one request until the answer."""
        d = self.dispatch
        if prefill is not None:
            prefill.inflight += 1
            prefill.queued_prefill_tokens += uncached
        decode.inflight += 1
        start = time.perf_counter()
        ans: Stage1Answer | None = None
        try:
            assert d.session is not None
            ans = await post_stage1(d.session, url + path, body, headers, d.timeout, transfer_id)
            return ans, time.perf_counter() - start
        finally:
            if prefill is not None:
                prefill.inflight -= 1
                prefill.queued_prefill_tokens -= uncached
            decode.inflight -= 1
            if ans is None:  # cancelled: the client went away; the closed connection aborts the prefill
                d.metrics.count(url, "aborted")
            else:
                self.metrics.stage1_answers.labels(ans.kind).inc()
                if ans.kind == OK:
                    self.metrics.stage1.observe(time.perf_counter() - start)

    async def _wait(self, st: Attempts) -> APIError | None:
        """Pause after every decode engine refused; None to try again, or the 503 to answer."""
        s = self.dispatch.settings
        now = time.monotonic()
        if st.wait_started is None:
            if self.queued >= s.pd_max_queued:
                self.metrics.queue_rejected.labels("full").inc()
                return no_decode_capacity(f"{self.queued} requests already wait for room, the most allowed "
                                          f"(--pd-max-queued {s.pd_max_queued})")
            self.queued += 1
            st.wait_started = now
        left = st.wait_started + s.pd_queue_timeout_s - now
        if left <= 0:
            self.metrics.queue_rejected.labels("timeout").inc()
            return no_decode_capacity(f"none freed room within {s.pd_queue_timeout_s:g}s "
                                      "(--pd-queue-timeout)")
        await asyncio.sleep(min(backoff_s(st.waits), left))
        st.waits += 1
        return None

    async def _fallback(self, reason: str, info: PromptInfo, body: bytes, headers: dict[str, str],
                        send: proxy.Send, path: str, t0: float, decided: bool) -> None:
        """Serve the request plain on a decode engine (it prefills it itself). Without a session:
        sessions stay bound to prefill engines, where their prompts' cache is computed."""
        self.metrics.fallback.labels(reason).inc()
        await self.dispatch.serve_plain(info, body, headers, send, path, None, t0, observe_decision=not decided)


def _non_negative(value: Any) -> int:
    return value if isinstance(value, int) and value > 0 else 0
