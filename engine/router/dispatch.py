"""Choose an engine and relay a request to it: the one place a request meets the fleet.

`RouterApp` (the ASGI app) and the two-stage flow (engine/router/disagg.py) both call down into
a `Dispatcher`; it never calls back up. It owns the pools (`fleet`: decode or colocated,
`prefill_fleet` when disaggregated, both set at startup), the sessions and the policy; a pick is
`choose` (filters and scores in engine/router/policies.py over the pool's endpoints and prefix
matches), a relay is `attempt` (one engine, with the load and metric bookkeeping), and
`serve_plain` is the plain flow: pick, relay, retry on another engine, or answer 503/429.

Invariant: an engine's ``inflight`` and ``queued_prefill_tokens`` count exactly the attempts
relaying to it now (added before the relay, removed when it ends, whatever the outcome), and its
``prefill`` clock (engine/router/rates.py) is busy exactly while ``queued_prefill_tokens > 0``:
it is told of every addition and removal, and times only removals at a first byte.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp

from kvmesh.engine.router import proxy
from kvmesh.engine.router.discovery import EngineState, Fleet
from kvmesh.engine.router.metrics import RouterMetrics
from kvmesh.engine.router.policies import Policy, RouteRequest, pick
from kvmesh.engine.router.policies import saturated as policy_saturated
from kvmesh.engine.router.prompt import PromptInfo, matched_tokens
from kvmesh.engine.router.proxy import all_engines_down, shedding
from kvmesh.engine.router.sessions import SessionTable

if TYPE_CHECKING:
    from kvmesh.engine.router.app import RouterSettings

log = logging.getLogger(__name__)


def explain(req: RouteRequest, endpoints: list, scores: dict[str, float]) -> str:
    """Why a pick went where it did: every endpoint's inputs and score (nan: filtered out)."""
    parts = []
    for e in endpoints:
        m = req.matches.get(e.id)
        cached = matched_tokens(m.blocks, req.block_size, req.prompt_tokens) if m else 0
        parts.append(f"{e.id} score={scores.get(e.id, float('nan')):.3f} cached={cached} "
                     f"queued={e.queued_prefill_tokens} running={e.running} "
                     f"spt={e.prefill_s_per_token} decode_s={e.decode_s_per_seq}")
    return "; ".join(parts)


@dataclass
class Lease:
    """One request's share of an engine's load, as the router counts it (the module invariant):
    ``inflight`` + 1 and ``pending`` prefill tokens queued from ``take`` until ``release``; the
    tokens leave the queue at ``first_token`` (timed: the engine prefilled them) or at ``release``
    (untimed). ``release`` is idempotent, so every path that ends a request may call it."""

    state: EngineState | None
    pending: int
    released: bool = False
    prefilled: bool = False

    @classmethod
    def take(cls, state: EngineState | None, uncached: int) -> Lease:
        if state is not None:
            state.inflight += 1
            if uncached > 0:
                state.prefill.queued(state.queued_prefill_tokens, time.monotonic())
            state.queued_prefill_tokens += uncached
        return cls(state, uncached)

    def first_token(self) -> None:
        """The engine has prefilled this prompt: its tokens leave the queue (a chat stream's
        role-only first event comes before that, so the first byte would be too early)."""
        st = self.state
        if self.prefilled or self.released:
            return
        self.prefilled = True
        if st is not None:
            st.queued_prefill_tokens -= self.pending
            st.prefill.drained(self.pending, st.queued_prefill_tokens, time.monotonic())
        self.pending = 0

    def release(self) -> None:
        st = self.state
        if self.released:
            return
        self.released = True
        if st is None:
            return
        st.inflight -= 1
        if self.pending:
            st.queued_prefill_tokens -= self.pending
            st.prefill.drained(self.pending, st.queued_prefill_tokens, time.monotonic(), measured=False)
        self.pending = 0


class Dispatcher:
    def __init__(self, settings: RouterSettings, policy: Policy, sessions: SessionTable, metrics: RouterMetrics,
                 timeout: aiohttp.ClientTimeout) -> None:
        self.settings, self.policy, self.sessions, self.metrics, self.timeout = (
            settings, policy, sessions, metrics, timeout)
        self.fleet: Fleet | None = None
        self.prefill_fleet: Fleet | None = None
        self.session: aiohttp.ClientSession | None = None
        self._turn = itertools.count()

    def choose(self, fleet: Fleet, policy: Policy, info: PromptInfo, session: str | None,
               exclude: frozenset[str], now: float, receiving_only: bool = False,
               turn: int | None = None) -> tuple[str | None, int]:
        """(engine URL or None, predicted cached prompt tokens on it) for ``policy`` over ``fleet``.

        ``receiving_only`` keeps the engines that report a KV transfer port (decode engines);
        ``turn`` rotates ties (default: the router's own counter; a pool picked in step with
        another needs its own, or ties would rotate in lockstep and always land on one engine).
        A session is bound to the engine chosen for it, and the prompt is recorded on it where
        the engine publishes no KV events (``Fleet.note_routed``).
        """
        if receiving_only:
            endpoints = [st.endpoint() for st in fleet.engines.values() if st.transfer_port is not None]
        else:
            endpoints = fleet.endpoints()
        matches, block_size = fleet.prefix_matches(info)
        target = self.sessions.target(session, now) if session else None
        req = RouteRequest(info.num_prompt_tokens, block_size, matches, session, target, exclude)
        scores = policy.scores(req, endpoints)
        chosen = pick(scores, next(self._turn) if turn is None else turn)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("pick %s for %d prompt tokens: %s", chosen, req.prompt_tokens, explain(req, endpoints, scores))
        if chosen is not None and session:
            self.sessions.bind(session, chosen, now)
        if chosen is not None:
            fleet.note_routed(chosen, info)
        m = matches.get(chosen) if chosen else None
        predicted = matched_tokens(m.blocks, block_size, len(info.token_ids)) if m and info.token_ids else 0
        return chosen, predicted

    async def serve_plain(self, info: PromptInfo, body: bytes, headers: dict[str, str], send: proxy.Send,
                           path: str, session: str | None, t0: float, observe_decision: bool = True) -> None:
        """The request as is on one engine of the decode (or colocated) pool, retried on others
        (``observe_decision``: False when the two-stage flow already timed this request's decision)."""
        assert self.fleet is not None
        if self.saturated(self.fleet, frozenset()):
            await proxy.send_error(send, shedding())
            self.metrics.count("none", "shed")
            return
        exclude: set[str] = set()
        tried: list[str] = []
        last_retry: proxy.Retry | None = None
        for attempt_no in range(self.settings.max_attempts):
            url, predicted = self.choose(self.fleet, self.policy, info, session, frozenset(exclude),
                                         time.monotonic())
            if attempt_no == 0 and observe_decision:
                self.metrics.decision.observe(time.perf_counter() - t0)
            if url is None:
                break
            result = await self.attempt(self.fleet.engines.get(url), url, path, body, headers, send, info,
                                         predicted)
            if isinstance(result, proxy.Done):
                return
            exclude.add(url)
            tried.append(f"{url}: {result.detail}")
            last_retry = result
            self.metrics.retries.labels(result.reason).inc()
            if result.engine_down:
                self.fleet.mark_failed(url, result.detail)
        if last_retry is not None and last_retry.status == 429:
            # Every engine is busy: their own answer (with Retry-After) says it best.
            await proxy.send_json(send, 429, last_retry.body, [h for h in last_retry.headers
                                                               if h[0] != b"content-type"])
        else:
            await proxy.send_error(send, all_engines_down(tried))
        self.metrics.count("none", "unavailable")

    def observe_cached(self, info: PromptInfo, predicted: int, cached_tokens: int | None) -> None:
        """Predicted minus reported cached tokens, when the engine reported them for a prompt the
        router tokenized whole (a multi-prompt request's first prompt does not stand for the rest)."""
        if cached_tokens is not None and info.token_ids is not None \
                and len(info.token_ids) == info.num_prompt_tokens:
            self.metrics.cached_error.observe(predicted - cached_tokens)

    def saturated(self, fleet: Fleet, exclude: frozenset[str]) -> bool:
        """Whether to shed a new request (429): ``LoadModel.shed_running`` is set and every healthy
        candidate already has that many requests in flight."""
        return policy_saturated([st.endpoint() for st in fleet.engines.values()], exclude, self.settings.load)

    async def attempt(self, state: EngineState | None, url: str, path: str, body: bytes,
                       headers: dict[str, str], send: proxy.Send, info: PromptInfo, predicted: int, *,
                       uncached: int | None = None, ttft_extra_s: float = 0.0,
                       retry_statuses: frozenset[int] = proxy.RETRY_STATUSES) -> proxy.Retry | proxy.Done:
        """One relay to ``url``. ``uncached``: prompt tokens the engine must compute (default: the
        prompt less ``predicted``); ``ttft_extra_s``: time already spent upstream for this answer
        (stage 1), counted into the TTFT metric."""
        if uncached is None:
            uncached = max(0, info.num_prompt_tokens - predicted)

        def first_byte(seconds: float) -> None:
            self.metrics.ttft.observe(seconds + ttft_extra_s)

        def engine_failed(why: str) -> None:
            if self.fleet is not None:
                self.fleet.mark_failed(url, why)

        lease = Lease.take(state, uncached)
        outcome = "aborted"
        try:
            result = await proxy.attempt(self.session, url + path, body, headers, send,
                                         proxy.Hooks(first_byte, engine_failed, lease.first_token), self.timeout,
                                         retry_statuses)
            if isinstance(result, proxy.Done):
                outcome = result.outcome
                self.observe_cached(info, predicted, result.cached_tokens)
            else:
                outcome = ""
            return result
        finally:
            lease.release()
            if outcome:
                self.metrics.count(url, outcome)
