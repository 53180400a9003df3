"""Routing policies as filters and scorers over (request, endpoints), combined by weight, then a pick.

Everything here is a pure function of its arguments: the proxy builds an immutable view of the
request and of every endpoint, the policy answers with an endpoint id. No I/O, no clocks, no
randomness (ties rotate by a counter the caller passes), so every decision is reproducible in
a test.

Score (docs/router.md explains it), in seconds of the endpoint's own measured work:

    score(e) = W_prefix * saved_s(e) - W_load * load_s(e) + W_affinity * [e is the session's]
               (W_prefix = PREFIX_WEIGHT = 2, W_load = 1)

    saved_s(e) = saved_tokens(e) * spt(e)
    load_s(e)  = (queued_prefill_tokens(e) + prompt_tokens) * spt(e) + running(e) * decode_s(e)

    saved_tokens(e) = block_size * weighted matched blocks of e   (tier weights gpu > cpu > remote)

``spt`` (prefill seconds per token) and ``decode_s`` (seconds per running sequence) are what the
router measured on that engine (engine/router/rates.py); until it has, the median of its measured
peers' stands in (``with_peer_rates``), and with no peer measured the ``LoadModel`` priors, where a
running request costs ``running_cost_tokens`` prefill tokens.

With unit weights, ``-score(e)`` is the predicted time to this request's first token on ``e``:
the prefill queued ahead of it and its own uncached prefill (prompt - saved) at that engine's
rate, plus the decode batch its prefill step shares. The prefix weight of 2 also charges a
replica for the work it adds ahead of later requests: a prefix cached on a busy engine is
replicated to another one once the owner's predicted wait exceeds the other's by more than
twice the prefix's recompute there. Invariant: when every endpoint has the same rates (in
particular when none is measured) the score is the token score
(W_prefix * saved - queued - running_cost_tokens * running) times ``spt``, less one constant,
so it picks the same endpoints. ``prefix_scorer``/``load_scorer`` (tokens) remain for the decode-pool pick
of two-stage serving.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from kvmesh.engine.router.index import PrefixMatch

POLICIES = ("cache-aware", "session", "least-load", "round-robin")
AFFINITY_WEIGHT = 1e12
"""Large enough that no prefix or load difference can outweigh a live session binding."""
_TIE_EPSILON = 1e-9
PREFIX_WEIGHT = 2.0
"""Weight of the prefix saving against the load. A replica's recompute is paid twice: by this
request's first token, and as prefill work queued ahead of the requests that reach the other
engine after it (its whole cost to the fleet when the fleet is busy); 1 counts the first only,
and with the queue counted in full, lets rate noise between engines move conversations back and
forth, each move evicting and recomputing a prefix."""


@dataclass(frozen=True)
class Endpoint:
    """The routing view of one engine at decision time.

    ``running`` counts requests in flight (the router's own count, raised to what the engine
    last reported when that is higher: other router replicas send work too);
    ``queued_prefill_tokens`` is the uncached prompt tokens this router sent that have not
    produced a first token yet; ``free_blocks`` the free KV blocks the engine last reported in
    its ``/metrics`` (None: not reported), read by the decode-pool policy of disaggregated
    serving. ``prefill_s_per_token`` and ``decode_s_per_seq`` are the engine's measured rates
    (engine/router/rates.py; None: not measured yet, the ``LoadModel`` priors apply).
    """

    id: str
    healthy: bool = True
    draining: bool = False
    running: int = 0
    queued_prefill_tokens: int = 0
    free_blocks: int | None = None
    prefill_s_per_token: float | None = None
    decode_s_per_seq: float | None = None


@dataclass(frozen=True)
class RouteRequest:
    """What a policy knows about one request.

    ``matches`` maps endpoint id to that endpoint's longest cached prefix of the prompt (absent:
    nothing cached, or the prompt could not be tokenized); ``block_size`` converts matched
    blocks to tokens. ``session`` is the session key (``x-session-id`` or the ``user`` field)
    and ``session_target`` the endpoint it is bound to, if any.
    """

    prompt_tokens: int = 0
    block_size: int = 16
    matches: Mapping[str, PrefixMatch] = field(default_factory=dict)
    session: str | None = None
    session_target: str | None = None
    exclude: frozenset[str] = frozenset()


@dataclass(frozen=True)
class LoadModel:
    """How requests in flight weigh against prefill tokens (``running_cost_tokens`` per request),
    and the priors for an engine whose rates are not measured yet."""

    running_cost_tokens: float = 64.0
    max_running: int = 0
    """An endpoint with this many requests in flight is skipped while another is below it (0: no cap)."""
    prefill_s_per_token: float = 0.002
    """Prior prefill seconds per token (500 tok/s) for an endpoint not measured yet."""
    shed_running: int = 0
    """A new request is refused (429) when every candidate has this many requests in flight (0: never)."""

    def prefill_spt(self, e: Endpoint) -> float:
        """``e``'s measured prefill seconds per token, else the prior (always > 0)."""
        m = e.prefill_s_per_token
        return m if m is not None and m > 0 else self.prefill_s_per_token

    def decode_s(self, e: Endpoint) -> float:
        """Seconds one running request of ``e`` adds ahead of a new first token: measured, else
        ``running_cost_tokens`` at ``e``'s prefill rate."""
        m = e.decode_s_per_seq
        return m if m is not None and m >= 0 else self.running_cost_tokens * self.prefill_spt(e)


Filter = Callable[[RouteRequest, Sequence[Endpoint]], list[Endpoint]]
Scorer = Callable[[RouteRequest, Sequence[Endpoint]], dict[str, float]]


# ---- filters -----------------------------------------------------------------------------
def healthy_filter(req: RouteRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
    """Endpoints that answer ``/ready`` and were not excluded (already tried for this request)."""
    return [e for e in endpoints if e.healthy and e.id not in req.exclude]


def not_draining_filter(req: RouteRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
    return [e for e in endpoints if not e.draining]


def load_cap_filter(load: LoadModel) -> Filter:
    """Drop endpoints at ``load.max_running``; keep all when every one is at the cap.

    The cap steers work away from saturated engines; it never refuses work by itself, since
    queueing on an engine beats a 503 when the whole pool is busy (the engine's own queue
    limit answers 429 when it must).
    """

    def under_cap(req: RouteRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        if load.max_running <= 0:
            return list(endpoints)
        below = [e for e in endpoints if e.running < load.max_running]
        return below or list(endpoints)

    return under_cap


def saturated(endpoints: Sequence[Endpoint], exclude: frozenset[str], load: LoadModel) -> bool:
    """Whether to shed a new request: ``load.shed_running`` > 0 and every healthy, not draining
    candidate (not in ``exclude``) runs that many requests or more. False when there is no
    candidate at all (that is a 503, not a 429)."""
    if load.shed_running <= 0:
        return False
    live = [e for e in endpoints if e.healthy and not e.draining and e.id not in exclude]
    return bool(live) and all(e.running >= load.shed_running for e in live)


# ---- scorers -----------------------------------------------------------------------------
def load_of(e: Endpoint, load: LoadModel) -> float:
    return e.queued_prefill_tokens + load.running_cost_tokens * e.running


def prefix_scorer(req: RouteRequest, endpoints: Sequence[Endpoint]) -> dict[str, float]:
    """Prefill tokens each endpoint would skip, tier-weighted, capped at the prompt length."""
    out = {}
    for e in endpoints:
        m = req.matches.get(e.id)
        saved = m.weighted * req.block_size if m else 0.0
        out[e.id] = min(saved, float(req.prompt_tokens)) if req.prompt_tokens else saved
    return out


def load_scorer(load: LoadModel) -> Scorer:
    """Minus each endpoint's load, in prefill tokens (higher is better)."""

    def score(req: RouteRequest, endpoints: Sequence[Endpoint]) -> dict[str, float]:
        return {e.id: -load_of(e, load) for e in endpoints}

    return score


def prefix_seconds_scorer(load: LoadModel) -> Scorer:
    """Prefill seconds each endpoint would skip: ``prefix_scorer``'s tokens at its own rate.

    The rate is the endpoint's own because the saving is what that engine would otherwise
    spend: a prefix cached on a slow engine saves more seconds than on a fast one.
    """

    def score(req: RouteRequest, endpoints: Sequence[Endpoint]) -> dict[str, float]:
        tokens = prefix_scorer(req, endpoints)
        return {e.id: tokens[e.id] * load.prefill_spt(e) for e in endpoints}

    return score


def load_seconds_of(e: Endpoint, load: LoadModel, prompt_tokens: int = 0) -> float:
    """Predicted seconds until a new request of ``prompt_tokens`` gets its first token on ``e``
    if nothing of it were cached: the queued prefill and its own at ``e``'s rate, plus the running
    batch's decode share (>= 0; the prefix scorer credits back what ``e`` has cached)."""
    return (e.queued_prefill_tokens + prompt_tokens) * load.prefill_spt(e) + e.running * load.decode_s(e)


def load_seconds_scorer(load: LoadModel) -> Scorer:
    """Minus ``load_seconds_of`` each endpoint for this request's prompt (higher is better)."""

    def score(req: RouteRequest, endpoints: Sequence[Endpoint]) -> dict[str, float]:
        return {e.id: -load_seconds_of(e, load, req.prompt_tokens) for e in endpoints}

    return score


def affinity_scorer(req: RouteRequest, endpoints: Sequence[Endpoint]) -> dict[str, float]:
    """1 for the endpoint the request's session is bound to, 0 for the others."""
    return {e.id: 1.0 if req.session_target is not None and e.id == req.session_target else 0.0
            for e in endpoints}


def with_peer_rates(endpoints: Sequence[Endpoint]) -> list[Endpoint]:
    """``endpoints``, each rate not measured yet replaced by the median of the peers that have it.

    A pool's engines run one model on one kind of machine, so a peer's measurement predicts an
    unmeasured engine far better than the ``LoadModel`` prior. Scored at the prior instead, an
    engine looks as slow as the prior says (500 tok/s; a bf16 engine on one AMX core prefills at
    ~2,000), a busy measured peer keeps winning, and the idle engine, never picked, is never
    measured: on the fleet benchmark every request of a run went to one of two engines. With no
    peer measured, nothing changes (the priors apply).
    """
    spts = [e.prefill_s_per_token for e in endpoints if e.prefill_s_per_token is not None and e.prefill_s_per_token > 0]
    decs = [e.decode_s_per_seq for e in endpoints if e.decode_s_per_seq is not None and e.decode_s_per_seq >= 0]
    spt = statistics.median(spts) if spts else None
    dec = statistics.median(decs) if decs else None
    out = []
    for e in endpoints:
        fill: dict[str, float] = {}
        if spt is not None and (e.prefill_s_per_token is None or e.prefill_s_per_token <= 0):
            fill["prefill_s_per_token"] = spt
        if dec is not None and (e.decode_s_per_seq is None or e.decode_s_per_seq < 0):
            fill["decode_s_per_seq"] = dec
        out.append(replace(e, **fill) if fill else e)
    return out


# ---- combine and pick --------------------------------------------------------------------
def combine(req: RouteRequest, endpoints: Sequence[Endpoint],
            scorers: Sequence[tuple[Scorer, float]]) -> dict[str, float]:
    """Weighted sum of every scorer's score per endpoint."""
    total = {e.id: 0.0 for e in endpoints}
    for scorer, weight in scorers:
        if weight == 0:
            continue
        for eid, s in scorer(req, endpoints).items():
            total[eid] += weight * s
    return total


def pick(scores: Mapping[str, float], turn: int) -> str | None:
    """The best-scoring endpoint id; among ties (within 1e-9) the ``turn % n``-th in id order.

    Rotating ties spreads requests that no scorer tells apart (an empty cache, equal loads)
    instead of piling them on the first endpoint; with no scorers it is plain round-robin.
    """
    if not scores:
        return None
    best = max(scores.values())
    tied = sorted(eid for eid, s in scores.items() if s >= best - _TIE_EPSILON * max(1.0, abs(best)))
    return tied[turn % len(tied)]


@dataclass(frozen=True)
class Policy:
    """A named pipeline: filters in order, then weighted scorers, then ``pick``."""

    name: str
    filters: tuple[Filter, ...]
    scorers: tuple[tuple[Scorer, float], ...]

    def scores(self, req: RouteRequest, endpoints: Sequence[Endpoint]) -> dict[str, float]:
        """The combined score of every endpoint that passes the filters (empty: none passes);
        unmeasured rates are the measured peers' (`with_peer_rates`)."""
        candidates = with_peer_rates(endpoints)
        for f in self.filters:
            candidates = f(req, candidates)
            if not candidates:
                return {}
        return combine(req, candidates, self.scorers)

    def choose(self, req: RouteRequest, endpoints: Sequence[Endpoint], turn: int) -> str | None:
        """The endpoint id to send ``req`` to, or None when no endpoint passes the filters."""
        return pick(self.scores(req, endpoints), turn)


def build_policy(name: str, load: LoadModel = LoadModel(), prefix_weight: float = PREFIX_WEIGHT,
                 load_weight: float = 1.0) -> Policy:
    """One of ``POLICIES``; raises ValueError naming the valid ones otherwise."""
    base = (healthy_filter, not_draining_filter)
    capped = base + (load_cap_filter(load),)
    saved, busy = prefix_seconds_scorer(load), load_seconds_scorer(load)
    if name == "cache-aware":
        return Policy(name, capped, ((saved, prefix_weight), (busy, load_weight)))
    if name == "session":
        # The affinity scorer dominates; the filters drop a gone or saturated target first, so
        # the same pipeline falls back to cache-aware on its own.
        return Policy(name, capped, ((affinity_scorer, AFFINITY_WEIGHT), (saved, prefix_weight),
                                     (busy, load_weight)))
    if name == "least-load":
        return Policy(name, capped, ((busy, 1.0),))
    if name == "round-robin":
        return Policy(name, base, ())
    raise ValueError(f"unknown routing policy {name!r}; use one of {', '.join(POLICIES)}")


def uses_prefix(policy: str) -> bool:
    """Whether ``policy`` reads prefix matches (so the proxy must tokenize and hash)."""
    return policy in ("cache-aware", "session")
