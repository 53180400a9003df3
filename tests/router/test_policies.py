"""Filters, scorers, combine and pick, and the session table, as pure functions."""

import pytest

from kvmesh.engine.router.index import PrefixMatch
from kvmesh.engine.router.policies import (
    AFFINITY_WEIGHT,
    Endpoint,
    LoadModel,
    RouteRequest,
    affinity_scorer,
    build_policy,
    combine,
    healthy_filter,
    load_cap_filter,
    load_of,
    load_scorer,
    not_draining_filter,
    pick,
    prefix_scorer,
    uses_prefix,
)
from kvmesh.engine.router.sessions import SessionTable, session_key

A, B, C = Endpoint("a"), Endpoint("b"), Endpoint("c")


def test_healthy_filter_drops_unhealthy_and_excluded():
    eps = [A, Endpoint("b", healthy=False), C]
    assert [e.id for e in healthy_filter(RouteRequest(), eps)] == ["a", "c"]
    assert [e.id for e in healthy_filter(RouteRequest(exclude=frozenset({"a"})), eps)] == ["c"]


def test_not_draining_filter():
    assert [e.id for e in not_draining_filter(RouteRequest(), [A, Endpoint("b", draining=True)])] == ["a"]


def test_load_cap_filter_steers_but_never_empties():
    cap = load_cap_filter(LoadModel(max_running=2))
    eps = [Endpoint("a", running=2), Endpoint("b", running=1)]
    assert [e.id for e in cap(RouteRequest(), eps)] == ["b"]
    full = [Endpoint("a", running=2), Endpoint("b", running=5)]
    assert [e.id for e in cap(RouteRequest(), full)] == ["a", "b"]
    assert len(load_cap_filter(LoadModel(max_running=0))(RouteRequest(), full)) == 2


def test_prefix_scorer_is_weighted_tokens_capped_at_the_prompt():
    req = RouteRequest(prompt_tokens=40, block_size=16,
                       matches={"a": PrefixMatch(2, {"gpu": 2}, 2.0), "b": PrefixMatch(3, {"remote": 3}, 1.5)})
    assert prefix_scorer(req, [A, B, C]) == {"a": 32.0, "b": 24.0, "c": 0.0}
    short = RouteRequest(prompt_tokens=20, block_size=16, matches={"a": PrefixMatch(2, {"gpu": 2}, 2.0)})
    assert prefix_scorer(short, [A])["a"] == 20.0


def test_load_scorer_counts_queued_tokens_and_running_requests():
    lm = LoadModel(running_cost_tokens=10)
    e = Endpoint("a", running=3, queued_prefill_tokens=100)
    assert load_of(e, lm) == 130
    assert load_scorer(lm)(RouteRequest(), [e, B]) == {"a": -130, "b": 0}


def test_affinity_scorer():
    assert affinity_scorer(RouteRequest(session_target="b"), [A, B]) == {"a": 0.0, "b": 1.0}
    assert affinity_scorer(RouteRequest(), [A, B]) == {"a": 0.0, "b": 0.0}


def test_combine_weights_and_pick_rotates_ties():
    req = RouteRequest()
    scores = combine(req, [A, B], [(lambda r, es: {"a": 1.0, "b": 2.0}, 2.0), (lambda r, es: {"a": 3.0}, 1.0)])
    assert scores == {"a": 5.0, "b": 4.0}
    assert pick(scores, 0) == "a"
    assert [pick({"a": 1.0, "b": 1.0, "c": 0.0}, t) for t in range(4)] == ["a", "b", "a", "b"]
    assert pick({}, 0) is None


def test_cache_aware_trades_saved_prefill_against_load():
    pol = build_policy("cache-aware", LoadModel(running_cost_tokens=64))
    matches = {"a": PrefixMatch(10, {"gpu": 10}, 10.0)}  # 160 tokens cached on a
    req = RouteRequest(prompt_tokens=200, block_size=16, matches=matches)
    assert pol.choose(req, [Endpoint("a", running=1), Endpoint("b")], 0) == "a"  # 160 - 64 > 0
    assert pol.choose(req, [Endpoint("a", running=3), Endpoint("b")], 0) == "b"  # 160 - 192 < 0
    assert pol.choose(req, [Endpoint("a", queued_prefill_tokens=500), Endpoint("b")], 0) == "b"
    assert pol.choose(req, [Endpoint("a", healthy=False), Endpoint("b")], 0) == "b"
    assert pol.choose(req, [Endpoint("a", healthy=False)], 0) is None


def test_session_sticks_then_falls_back_when_target_is_gone_or_saturated():
    pol = build_policy("session", LoadModel(max_running=4))
    req = RouteRequest(prompt_tokens=64, block_size=16, session="s", session_target="b",
                       matches={"a": PrefixMatch(4, {"gpu": 4}, 4.0)})
    assert pol.choose(req, [A, Endpoint("b", running=3)], 0) == "b"  # sticky despite a's cache
    assert pol.choose(req, [A, Endpoint("b", running=4)], 0) == "a"  # saturated: cache-aware
    assert pol.choose(req, [A, Endpoint("b", healthy=False)], 0) == "a"  # gone
    assert pol.choose(req, [A], 0) == "a"
    assert AFFINITY_WEIGHT > 1e9


def test_least_load_and_round_robin():
    ll = build_policy("least-load")
    assert ll.choose(RouteRequest(), [Endpoint("a", running=2), Endpoint("b", running=1)], 0) == "b"
    rr = build_policy("round-robin")
    eps = [Endpoint("a", running=9), B, C]
    assert [rr.choose(RouteRequest(), eps, t) for t in range(4)] == ["a", "b", "c", "a"]
    assert uses_prefix("cache-aware") and uses_prefix("session") and not uses_prefix("round-robin")
    with pytest.raises(ValueError, match="use one of cache-aware"):
        build_policy("random")


def test_session_table_expires_idle_bindings_and_bounds_its_size():
    t = SessionTable(idle_s=10, max_sessions=2)
    t.bind("s1", "a", now=0)
    assert t.target("s1", now=5) == "a"
    assert t.target("s1", now=16) is None and len(t) == 0
    t.bind("s1", "a", 20)
    t.bind("s2", "b", 21)
    t.bind("s3", "c", 22)
    assert len(t) == 2 and t.target("s1", 22) is None
    assert t.expire(now=31.5) == 1 and t.target("s3", 31.5) == "c"
    t.forget_endpoint("c")
    assert len(t) == 0
    with pytest.raises(ValueError, match="idle expiry"):
        SessionTable(idle_s=0)


def test_session_key_prefers_the_header_over_user():
    assert session_key({"x-session-id": "h"}, "u") == "h"
    assert session_key({}, "u") == "u"
    assert session_key({}, None) is None and session_key({}, 5) is None
