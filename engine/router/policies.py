"""Routing policies as filters and scorers over (request, endpoints), combined by weight, then a pick.

Everything here is a pure function of its arguments: the proxy builds an immutable view of the
request and of every endpoint, the policy answers with an endpoint id. No I/O, no clocks, no
randomness (ties rotate by a counter the caller passes), so every decision is reproducible in
a test.

Score (docs/router.md explains it):

    score(e) = W_prefix * saved_tokens(e) - W_load * load(e) + W_affinity * [e is the session's]

    saved_tokens(e) = block_size * weighted matched blocks of e   (tier weights gpu > cpu > remote)
    load(e)         = queued_prefill_tokens(e) + running_cost_tokens * running(e)

Both terms are in tokens of prefill work, so the cache-aware pick is the endpoint where this
request's first token is expected soonest: the prefill it would skip against the prefill
already queued ahead of it and the decode batch it would share.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvmesh.engine.router.index import PrefixMatch

POLICIES = ("cache-aware", "session", "least-load", "round-robin")
AFFINITY_WEIGHT = 1e12
"""Large enough that no prefix or load difference can outweigh a live session binding."""
_TIE_EPSILON = 1e-9


@dataclass(frozen=True)
class Endpoint:
    """The routing view of one engine at decision time.

    ``running`` counts requests in flight (the router's own count, raised to what the engine
    last reported when that is higher: other router replicas send work too);
    ``queued_prefill_tokens`` is the uncached prompt tokens this router sent that have not
    produced a first token yet; ``free_blocks`` the free KV blocks the engine last reported in
    its ``/metrics`` (None: not reported), read by the decode-pool policy of disaggregated
    serving.
    """

    id: str
    healthy: bool = True
    draining: bool = False
    running: int = 0
    queued_prefill_tokens: int = 0
    free_blocks: int | None = None


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
    """How requests in flight weigh against prefill tokens (``running_cost_tokens`` per request)."""

    running_cost_tokens: float = 64.0
    max_running: int = 0
    """An endpoint with this many requests in flight is skipped while another is below it (0: no cap)."""


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


def affinity_scorer(req: RouteRequest, endpoints: Sequence[Endpoint]) -> dict[str, float]:
    """1 for the endpoint the request's session is bound to, 0 for the others."""
    return {e.id: 1.0 if req.session_target is not None and e.id == req.session_target else 0.0
            for e in endpoints}


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

    def choose(self, req: RouteRequest, endpoints: Sequence[Endpoint], turn: int) -> str | None:
        """The endpoint id to send ``req`` to, or None when no endpoint passes the filters."""
        candidates = list(endpoints)
        for f in self.filters:
            candidates = f(req, candidates)
            if not candidates:
                return None
        return pick(combine(req, candidates, self.scorers), turn)


def build_policy(name: str, load: LoadModel = LoadModel(), prefix_weight: float = 1.0,
                 load_weight: float = 1.0) -> Policy:
    """One of ``POLICIES``; raises ValueError naming the valid ones otherwise."""
    base = (healthy_filter, not_draining_filter)
    capped = base + (load_cap_filter(load),)
    if name == "cache-aware":
        return Policy(name, capped, ((prefix_scorer, prefix_weight), (load_scorer(load), load_weight)))
    if name == "session":
        # The affinity scorer dominates; the filters drop a gone or saturated target first, so
        # the same pipeline falls back to cache-aware on its own.
        return Policy(name, capped, ((affinity_scorer, AFFINITY_WEIGHT), (prefix_scorer, prefix_weight),
                                     (load_scorer(load), load_weight)))
    if name == "least-load":
        return Policy(name, capped, ((load_scorer(load), 1.0),))
    if name == "round-robin":
        return Policy(name, base, ())
    raise ValueError(f"unknown routing policy {name!r}; use one of {', '.join(POLICIES)}")


def uses_prefix(policy: str) -> bool:
    """Whether ``policy`` reads prefix matches (so the proxy must tokenize and hash)."""
    return policy in ("cache-aware", "session")
