"""Filters, scorers, combine and pick, and the session table, as pure functions."""

from dataclasses import replace

import pytest

from kvmesh.engine.router.index import PrefixMatch
from kvmesh.engine.router.policies import (
    AFFINITY_WEIGHT,
    Endpoint,
    PREFIX_WEIGHT,
    LoadModel,
    Policy,
    RouteRequest,
    affinity_scorer,
    build_policy,
    combine,
    healthy_filter,
    load_cap_filter,
    load_of,
    load_scorer,
    load_seconds_of,
    load_seconds_scorer,
    not_draining_filter,
    pick,
    prefix_scorer,
    prefix_seconds_scorer,
    saturated,
    uses_prefix,
    with_peer_rates,
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


def test_seconds_scorers_use_each_endpoints_measured_rates_else_the_priors():
    lm = LoadModel(running_cost_tokens=10, prefill_s_per_token=0.002)
    slow = Endpoint("a", running=2, queued_prefill_tokens=100, prefill_s_per_token=0.004, decode_s_per_seq=0.03)
    unmeasured = Endpoint("b", running=3, queued_prefill_tokens=100)
    assert load_seconds_of(slow, lm) == pytest.approx(100 * 0.004 + 2 * 0.03)
    assert load_seconds_of(unmeasured, lm) == pytest.approx((100 + 3 * 10) * 0.002)  # the token load at the prior
    assert load_seconds_scorer(lm)(RouteRequest(), [slow])["a"] == pytest.approx(-0.46)
    # The request's own prompt counts at each endpoint's rate: the faster one wins an empty cache.
    assert load_seconds_scorer(lm)(RouteRequest(prompt_tokens=50), [slow])["a"] == pytest.approx(-0.66)
    req = RouteRequest(prompt_tokens=40, block_size=16, matches={"a": PrefixMatch(2, {"gpu": 2}, 2.0),
                                                                "b": PrefixMatch(2, {"gpu": 2}, 2.0)})
    saved = prefix_seconds_scorer(lm)(req, [slow, unmeasured])
    assert saved["a"] == pytest.approx(32 * 0.004) and saved["b"] == pytest.approx(32 * 0.002)


def test_without_measurements_the_seconds_policy_picks_what_the_token_policy_did():
    """Invariant: unmeasured, every seconds score is the token score times the prior, so each pick
    (the tie rotation included) is the token policy's."""
    token_policy = Policy("tokens", (), ((prefix_scorer, PREFIX_WEIGHT), (load_scorer(LoadModel()), 1.0)))
    seconds_policy = build_policy("cache-aware")
    cases = 0
    for cached_a in (0, 4, 10, 40):
        for cached_b in (0, 2, 10):
            for run_a, run_b in ((0, 0), (1, 0), (3, 1), (0, 5)):
                for q_a, q_b in ((0, 0), (500, 0), (0, 160), (64, 64)):
                    req = RouteRequest(prompt_tokens=700, block_size=16, matches={
                        "a": PrefixMatch(cached_a, {"gpu": cached_a}, float(cached_a)),
                        "b": PrefixMatch(cached_b, {"cpu": cached_b}, 0.8 * cached_b)})
                    eps = [Endpoint("a", running=run_a, queued_prefill_tokens=q_a),
                           Endpoint("b", running=run_b, queued_prefill_tokens=q_b)]
                    for turn in (0, 1):
                        assert seconds_policy.choose(req, eps, turn) == token_policy.choose(req, eps, turn)
                        cases += 1
    assert cases == 384


def test_unmeasured_engines_take_their_measured_peers_median_rates():
    measured = [Endpoint("a", prefill_s_per_token=0.0004, decode_s_per_seq=0.03),
                Endpoint("b", prefill_s_per_token=0.0006, decode_s_per_seq=0.01),
                Endpoint("c", prefill_s_per_token=0.0020)]
    filled = with_peer_rates([*measured, Endpoint("d", running=3), Endpoint("e", decode_s_per_seq=0.05)])
    # medians: prefill of 0.4, 0.6 and 2 ms/token; decode of 10, 30 and 50 ms (e's counts too)
    assert filled[:3] == measured[:2] + [Endpoint("c", prefill_s_per_token=0.0020, decode_s_per_seq=0.03)]
    assert (filled[3].prefill_s_per_token, filled[3].decode_s_per_seq, filled[3].running) == (0.0006, 0.03, 3)
    assert (filled[4].prefill_s_per_token, filled[4].decode_s_per_seq) == (0.0006, 0.05)
    unmeasured = [Endpoint("a", running=1), Endpoint("b")]
    assert with_peer_rates(unmeasured) == unmeasured  # nobody measured: the priors apply


def test_an_idle_unmeasured_engine_is_not_scored_at_the_prior_beside_a_measured_busy_one():
    """The fleet benchmark's picks (bf16, one core per engine): ``a`` measured at ~2,000 tok/s and
    busy with a 1,327-token prefill, ``b`` idle and never picked. At the 500 tok/s prior ``b``'s own
    prefill of the cold 964-token prompt looked like 1.93 s, more than ``a``'s whole queue, so every
    request of the run went to ``a``; at ``a``'s rate it is 0.48 s and ``b`` takes it."""
    pol = build_policy("cache-aware")
    req = RouteRequest(prompt_tokens=964, block_size=16)
    busy = Endpoint("a", running=2, queued_prefill_tokens=1327, prefill_s_per_token=0.000508, decode_s_per_seq=0.035)
    idle = Endpoint("b")
    assert load_seconds_scorer(LoadModel())(req, [idle])["b"] < load_seconds_scorer(LoadModel())(req, [busy])["a"]
    assert pol.choose(req, [busy, idle], 0) == "b"
    # A prefix cached on the busy engine still keeps its conversation there while that pays.
    hit = RouteRequest(prompt_tokens=1328, block_size=16, matches={"a": PrefixMatch(76, {"gpu": 76}, 76.0)})
    assert pol.choose(hit, [replace(busy, queued_prefill_tokens=1215), idle], 0) == "a"


def test_a_hot_prefix_is_replicated_once_its_owners_queue_costs_more_than_it_saves():
    """1,504 tokens cached on ``a``; the request's 1,600 cost ``b`` 3.2 s at 2 ms/token. With the
    prefix weighed twice (this request, and the work a replica queues ahead of later ones),
    ``a``'s score is -(queued + 1600 - 2 * 1504) * spt_a - running * 10 ms: ``a`` keeps the request
    until its queue predicts 3.2 s more than that, ``b`` takes it (a replica) after."""
    assert PREFIX_WEIGHT == 2.0
    pol = build_policy("cache-aware")
    req = RouteRequest(prompt_tokens=1600, block_size=16, matches={"a": PrefixMatch(94, {"gpu": 94}, 94.0)})
    idle_b = Endpoint("b", prefill_s_per_token=0.002, decode_s_per_seq=0.01)

    def owner(queued, running, spt=0.002):
        return Endpoint("a", running=running, queued_prefill_tokens=queued, prefill_s_per_token=spt,
                        decode_s_per_seq=0.01)

    assert pol.choose(req, [owner(2000, 4), idle_b], 0) == "a"  # 1.22 s < 3.2 s
    assert pol.choose(req, [owner(3100, 4), idle_b], 0) == "b"  # 3.42 s > 3.2 s
    # The same queue on an owner slowed to 4 ms/token (a big decode batch) costs twice the seconds.
    assert pol.choose(req, [owner(2400, 4), idle_b], 0) == "a"  # 2.02 s
    assert pol.choose(req, [owner(2400, 4, spt=0.004), idle_b], 0) == "b"  # 4.01 s
    # A running batch counts at its measured step share.
    assert pol.choose(req, [owner(2000, 150), idle_b], 0) == "a"  # 1.18 + 1.5 < 3.2
    assert pol.choose(req, [owner(2000, 250), idle_b], 0) == "b"  # 1.18 + 2.5 > 3.2
    # A busy other engine keeps the request on the owner longer.
    busy_b = Endpoint("b", queued_prefill_tokens=500, prefill_s_per_token=0.002, decode_s_per_seq=0.01)
    assert pol.choose(req, [owner(3100, 4), busy_b], 0) == "a"


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
    pol = build_policy("cache-aware", LoadModel(running_cost_tokens=64), prefix_weight=1.0)
    matches = {"a": PrefixMatch(10, {"gpu": 10}, 10.0)}  # 160 tokens cached on a
    req = RouteRequest(prompt_tokens=200, block_size=16, matches=matches)
    assert pol.choose(req, [Endpoint("a", running=1), Endpoint("b")], 0) == "a"  # 160 - 64 > 0
    assert pol.choose(req, [Endpoint("a", running=3), Endpoint("b")], 0) == "b"  # 160 - 192 < 0
    assert pol.choose(req, [Endpoint("a", queued_prefill_tokens=500), Endpoint("b")], 0) == "b"
    assert pol.choose(req, [Endpoint("a", healthy=False), Endpoint("b")], 0) == "b"
    assert pol.choose(req, [Endpoint("a", healthy=False)], 0) is None


def test_scores_are_the_filtered_candidates_combined_and_choose_picks_their_best():
    pol = build_policy("cache-aware", LoadModel(running_cost_tokens=64), prefix_weight=1.0)
    req = RouteRequest(prompt_tokens=200, block_size=16, matches={"a": PrefixMatch(10, {"gpu": 10}, 10.0)})
    eps = [Endpoint("a", running=1), Endpoint("b"), Endpoint("c", healthy=False)]
    scores = pol.scores(req, eps)
    assert set(scores) == {"a", "b"}  # c is filtered out
    assert scores["a"] > scores["b"] and pol.choose(req, eps, 0) == pick(scores, 0) == "a"
    assert pol.scores(req, [Endpoint("c", healthy=False)]) == {}


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


def test_saturated_sheds_only_when_every_live_candidate_is_at_the_limit():
    load = LoadModel(shed_running=2)
    busy, free = Endpoint("a", running=2), Endpoint("b", running=1)
    assert not saturated([busy, free], frozenset(), load)
    assert saturated([busy, free], frozenset({"b"}), load)  # the only candidate left is full
    assert saturated([busy, Endpoint("b", healthy=False), Endpoint("c", draining=True)], frozenset(), load)
    assert not saturated([], frozenset(), load)  # no candidate at all is a 503, not a 429
    assert not saturated([busy], frozenset(), LoadModel())  # 0: never shed
