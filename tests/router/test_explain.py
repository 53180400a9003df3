"""The router's debug account of a pick (engine/router/dispatch.py ``explain``), a pure function."""

from kvmesh.engine.router.dispatch import explain
from kvmesh.engine.router.index import PrefixMatch
from kvmesh.engine.router.policies import Endpoint, LoadModel, RouteRequest, build_policy


def test_explain_names_every_endpoints_inputs_and_score():
    pol = build_policy("cache-aware", LoadModel())
    req = RouteRequest(prompt_tokens=100, block_size=16, matches={"a": PrefixMatch(3, {"gpu": 3}, 3.0)})
    eps = [Endpoint("a", running=2, prefill_s_per_token=0.003), Endpoint("b", queued_prefill_tokens=40),
           Endpoint("c", healthy=False)]
    text = explain(req, eps, pol.scores(req, eps))
    a, b, c = text.split("; ")
    assert a.startswith("a score=") and "cached=48" in a and "running=2" in a and "spt=0.003" in a
    assert "cached=0" in b and "queued=40" in b and "spt=None" in b
    assert c.startswith("c score=nan")  # filtered out: no score
