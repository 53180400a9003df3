"""The CacheAwareRouting condition from router pods' /ready bodies (pure)."""

from kvmesh.operator.routing_status import ROUTING, routing_condition

NOW, LATER = "2026-12-01T10:00:00Z", "2026-12-01T10:05:00Z"
GOOD = {"ready": True, "tokenizer": "ab" * 32, "tokenizer_problem": None, "mismatches": {}}


def cond(answers, policy="cache-aware", previous=None, now=NOW):
    return routing_condition(policy, answers, previous, now, 3)


def test_routers_with_a_tokenizer_and_no_mismatch_route_by_prefix():
    c = cond([("r-1", GOOD), ("r-2", GOOD)])
    assert (c["type"], c["status"], c["reason"]) == (ROUTING, "True", "PrefixRouting")
    assert "2 router pod(s)" in c["message"] and "abababababab" in c["message"] and c["observedGeneration"] == 3


def test_a_router_without_a_tokenizer_is_reported_with_its_problem():
    lost = {**GOOD, "ready": False, "tokenizer": None, "tokenizer_problem": "no engine gave its tokenizer (x: HTTP 404)"}
    c = cond([("r-1", GOOD), ("r-2", lost)])
    assert (c["status"], c["reason"]) == ("False", "NoTokenizer")
    assert "r-2: no engine gave its tokenizer (x: HTTP 404)" in c["message"]


def test_engines_hashing_other_blocks_are_named_with_the_field():
    c = cond([("r-1", {**GOOD, "mismatches": {"http://10.0.0.7:8000": "tokenizer"}})])
    assert (c["status"], c["reason"]) == ("False", "EngineMismatch")
    assert "http://10.0.0.7:8000 differs in tokenizer" in c["message"]


def test_no_answer_is_unknown_and_a_load_policy_has_no_condition():
    assert cond([("r-1", None), ("r-2", {"ready": True})])["status"] == "Unknown"  # an old router's body
    assert cond([])["reason"] == "NoRouterAnswer"
    assert cond([("r-1", GOOD)], policy="least-load") is None


def test_the_transition_time_moves_only_when_the_status_does():
    first = cond([("r-1", GOOD)])
    assert cond([("r-1", GOOD)], previous=first, now=LATER)["lastTransitionTime"] == NOW
    assert cond([("r-1", {**GOOD, "tokenizer": None})], previous=first, now=LATER)["lastTransitionTime"] == LATER
