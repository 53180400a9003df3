"""Recurrent-state checkpoint bookkeeping: the capture policy, the LRU index, state slots and the
per-step plan (engine/kv/state_checkpoints.py, state_slots.py, hybrid_state.py).

Real: the classes the engine uses, driven directly; hashes are the engine's block hashes.
"""

from __future__ import annotations

import pytest

from kvmesh.engine.block_hash import ROOT_HASH, hash_block
from kvmesh.engine.kv.hybrid_state import HybridStateManager
from kvmesh.engine.kv.state_checkpoints import BranchPoints, CheckpointIndex, capture_points, wanted_boundaries
from kvmesh.engine.kv.state_slots import StateSlots, StateSlotsExhausted


def _hashes(tokens, bs=4, extra=b"m"):
    out, prev = [], ROOT_HASH
    for i in range(len(tokens) // bs):
        prev = hash_block(prev, tokens[i * bs:(i + 1) * bs], extra)
        out.append(prev)
    return out


@pytest.mark.parametrize("start, end, prompt, interval, want", [
    (0, 10, 10, 0, ([8], None)),  # prompt end: (10 - 1) // 4 * 4 = 8
    (0, 9, 9, 0, ([8], None)),
    (0, 10, 10, 4, ([4, 8], None)),  # every block
    (0, 3, 10, 0, ([], None)),  # no boundary crossed
    (8, 16, 10, 0, ([], 16)),  # generation region: the last boundary is held, published at finish
    (11, 12, 10, 0, ([], 12)),  # a decode step reaching a boundary
    (8, 17, 10, 8, ([16], None)),  # a published interval point past the prompt supersedes the held one
    (0, 40, 10, 16, ([8, 16, 32], 40)),
    (0, 4, 1, 0, ([], 4)),  # a 1-token prompt has no prompt boundary
])
def test_capture_points(start, end, prompt, interval, want):
    """Which boundaries a step checkpoints, for prompt, interval and generation-end points."""
    assert capture_points(start, end, prompt, 4, interval) == want


def test_wanted_boundaries_are_published_with_the_others():
    assert capture_points(0, 16, 17, 4, 0, {8}) == ([8, 16], None)
    assert capture_points(8, 16, 17, 4, 0, {8}) == ([16], None)  # (start, end]: 8 was the last step's


def test_wanted_boundaries_come_from_branch_points_and_hints():
    """Branch points name blocks by hash, hints name positions (floored to a block boundary);
    both only inside the step's (start, end]."""
    h = _hashes(list(range(40)))  # 10 blocks of 4
    branches = BranchPoints()
    assert wanted_boundaries(h, 0, 40, 4, branches) == set()
    branches.add(h[2])  # block 2 ends at 12 tokens
    assert wanted_boundaries(h, 0, 40, 4, branches) == {12}
    assert wanted_boundaries(h, 12, 40, 4, branches) == set()
    assert wanted_boundaries(h[:5], 0, 20, 4, branches, hints=(7, 18, 30)) == {4, 12, 16}


def test_branch_points_are_bounded_and_say_what_they_displace():
    b = BranchPoints(capacity=2)
    assert b.add(b"a") == (True, None) and b.add(b"b") == (True, None)
    assert b.add(b"a") == (False, None)  # refreshed: now the newest
    assert b.add(b"c") == (True, b"b")
    assert b"a" in b and b"b" not in b and len(b) == 2


def test_a_hit_cut_back_short_of_its_kv_makes_a_branch_point_the_next_prompt_captures():
    """Prompt 1 leaves KV over 5 blocks and a checkpoint at its end only; prompt 2 shares 3 blocks:
    its hit is cut to 0 (no checkpoint at 3), so block 3's end becomes a branch point, announced,
    and prompt 2's own step captures there: prompt 3 then resumes from it."""
    toks = list(range(40))
    h = _hashes(toks)
    seen = []
    mgr = HybridStateManager(2, 4, CheckpointIndex(8), interval=0, on_branch=lambda h, old: seen.append((h, old)))
    assert mgr.hit(h, 3) == (0, None)
    assert seen == [(h[2], None)]
    assert mgr.hit(h, 3) == (0, None) and len(seen) == 1  # known: announced once
    mgr.allocate("p2")
    plan = mgr.plan([("p2", toks, ROOT_HASH, 22, 0, 22, ())], lambda rid, t, root, n: h[:n])
    assert [c[0] for c in plan.captures[0]] == [12, 20]  # the branch point and the prompt's end
    mgr.commit(plan)
    assert mgr.hit(h, 3)[0] == 3
    mgr.free("p2")
    mgr.check_integrity()


def test_index_lru_pins_and_content_addressing():
    """Publishing a held hash frees the duplicate; eviction takes the least recently used unpinned entry."""
    idx = CheckpointIndex(2, entry_bytes=100)
    h = _hashes(list(range(12)))
    a, b = idx.reserve(), idx.reserve()
    idx.publish(a, h[0])
    idx.publish(b, h[1])
    c = idx.reserve()  # evicts h[0], the oldest
    assert c == a and h[0] not in idx and idx.stats.evictions == 1
    idx.publish(c, h[1])  # duplicate content: c goes back to free
    assert idx.snapshot().published == 1
    idx.check_integrity()
    d = idx.reserve()
    idx.publish(d, h[2])
    idx.lookup(h[1])  # h[2] is now the oldest...
    idx.pin(d)  # ...but pinned, so h[1] goes
    e = idx.reserve()
    assert e == b and h[2] in idx and h[1] not in idx
    assert idx.reserve() is None and idx.stats.reserve_failures == 1  # d pinned, e reserved
    idx.unpin(d)
    idx.release(e)
    idx.check_integrity()


def test_hooks_report_exactly_the_indexed_hashes():
    """``on_publish``/``on_evict`` (what the engine turns into KV events) fire once per hash entering
    and leaving the index, never for a duplicate publish; replaying them gives the index's contents."""
    seen: set = set()
    calls: list = []

    def published(h):
        assert h not in seen
        seen.add(h)
        calls.append(("+", h))

    def evicted(entry, h):
        seen.remove(h)
        calls.append(("-", h))

    idx = CheckpointIndex(2, on_publish=published, on_evict=evicted)
    h = _hashes(list(range(16)))
    a, b = idx.reserve(), idx.reserve()
    idx.publish(a, h[0])
    idx.publish(b, h[1])
    c = idx.reserve()  # evicts h[0]
    idx.publish(c, h[1])  # a duplicate: no call
    d = idx.reserve()
    idx.release(d)  # a reserved entry given back unpublished: no call
    e = idx.reserve()
    idx.publish(e, h[2])
    assert calls == [("+", h[0]), ("+", h[1]), ("-", h[0]), ("+", h[2])]
    assert seen == {x for x in h if x in idx}
    idx.check_integrity()


def test_slots_are_exclusive_and_bounded():
    """A request keeps one slot; the pool refuses past its size; freeing returns the slot."""
    slots = StateSlots(2)
    assert slots.allocate("a") == slots.allocate("a") == 0
    assert slots.allocate("b") == 1
    with pytest.raises(StateSlotsExhausted, match="2 state slots"):
        slots.allocate("c")
    slots.free("a")
    slots.free("a")  # twice: ignored
    assert slots.allocate("c") == 0
    slots.check_integrity()


def test_plan_commit_publishes_and_abort_releases():
    """A step's captures become hits only after commit; a failed step publishes nothing; a finished
    request publishes the state it held at its last boundary."""
    toks = list(range(20))
    h = _hashes(toks)
    mgr = HybridStateManager(2, 4, CheckpointIndex(8), interval=0)
    mgr.allocate("r")

    def chain(rid, tokens, root, n):
        return h[:n]

    plan = mgr.plan([("r", toks, ROOT_HASH, 10, 0, 10, ())], chain)
    assert plan.captures == [[(8, 0)]] and plan.slots == [0]
    mgr.abort(plan)
    assert mgr.hit(h, 4) == (0, None)
    plan = mgr.plan([("r", toks, ROOT_HASH, 10, 0, 10, ())], chain)
    mgr.commit(plan)
    assert mgr.hit(h, 4)[0] == 2  # the prompt's boundary at 8 tokens = 2 blocks
    plan = mgr.plan([("r", toks, ROOT_HASH, 10, 10, 3, ())], chain)  # generation reaches 12
    mgr.commit(plan)
    assert mgr.hit(h, 4)[0] == 2  # held, not published yet
    mgr.free("r")
    assert mgr.hit(h, 4)[0] == 3
    mgr.check_integrity()
