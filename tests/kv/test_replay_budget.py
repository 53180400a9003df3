"""The replay budget alone (pure, the clock passed in): per-answer cap, per-client and global rates."""

from __future__ import annotations

import pytest

from kvmesh.engine.kv.replay_budget import ReplayBudget, ReplayLimits


def test_an_answer_is_capped_and_a_client_refills_at_its_rate():
    b = ReplayBudget(ReplayLimits(max_records=100, client_rate=50, total_rate=1e9))
    assert b.grant(b"a", 500, now=0.0) == 100  # the cap, and the whole burst
    assert b.grant(b"a", 500, now=0.0) == 0  # nothing left until time passes
    assert b.grant(b"a", 500, now=1.0) == 50  # one second at 50 records/s
    assert b.grant(b"a", 10, now=100.0) == 10  # never more than asked
    assert b.grant(b"b", 500, now=0.0) == 100  # another client has its own bucket


def test_all_clients_together_meet_the_global_rate():
    b = ReplayBudget(ReplayLimits(max_records=100, client_rate=1e9, total_rate=100))
    granted = sum(b.grant(bytes([i]), 100, now=0.0) for i in range(20))
    assert granted == 500  # the global burst (5 answers), however many identities ask
    assert sum(b.grant(bytes([i]), 100, now=1.0) for i in range(20, 40)) == 100


def test_forgotten_clients_keep_memory_bounded():
    b = ReplayBudget(ReplayLimits(clients=8, total_rate=1e12))
    for i in range(1000):
        b.grant(i.to_bytes(4, "big"), 1, now=float(i))
    assert len(b._clients) == 8


@pytest.mark.parametrize("bad", [dict(max_records=0), dict(client_rate=0), dict(total_rate=-1), dict(clients=0)])
def test_impossible_limits_are_refused(bad):
    with pytest.raises(ValueError, match="positive"):
        ReplayLimits(**bad)
