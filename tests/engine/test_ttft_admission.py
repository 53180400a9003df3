"""Admission by the TTFT target (``ttft_slo_s``), without a model: requests already past the
target yield to those that can still make it, and nothing else changes. Real: the scheduler and
the KV cache manager; time is the ``now`` the engine would pass."""

from __future__ import annotations

import pytest

from kvmesh.engine.block_hash import extra_key
from kvmesh.engine.kv.kv_manager import KVCacheManager
from kvmesh.engine.outputs import RequestMetrics
from kvmesh.engine.request import Request, RequestStatus
from kvmesh.engine.sampling import SamplingParams
from kvmesh.engine.scheduler import Scheduler

BS = 4


def _req(rid: str, n: int, arrival: float, seq: int, priority: int = 0) -> Request:
    return Request(rid, [10 * seq + 100 + i for i in range(n)], SamplingParams(max_tokens=4),
                   RequestMetrics(arrival_time=arrival), priority=priority, arrival_seq=seq)


def _sched(slo: float, max_seqs: int = 1, budget: int = 64) -> Scheduler:
    kv = KVCacheManager(64, BS, True, extra_key("m", "float32"))
    return Scheduler(kv, max_seqs, budget, ttft_slo_s=slo)


def _admitted(s: Scheduler, now: float) -> list[str]:
    out = s.schedule(now)
    s.update_after_step(out)
    return [q.request.request_id for q in out.seqs if q.num_computed_tokens == 0]


def test_a_request_past_the_target_yields_to_one_that_can_still_make_it():
    s = _sched(slo=1.0, max_seqs=1)
    old, new = _req("old", 8, arrival=0.0, seq=0), _req("new", 8, arrival=1.5, seq=1)
    s.add(old)
    s.add(new)
    assert _admitted(s, now=2.0) == ["new"]  # old has waited 2 s, new 0.5 s
    s.finish(new, "stop")
    assert _admitted(s, now=2.1) == ["old"], "a late request runs once no timely one waits"


def test_without_a_target_the_queue_is_first_come_first_served():
    s = _sched(slo=0.0, max_seqs=1)
    s.add(_req("old", 8, arrival=0.0, seq=0))
    s.add(_req("new", 8, arrival=1.5, seq=1))
    assert _admitted(s, now=2.0) == ["old"]


def test_late_requests_keep_their_order_and_timely_ones_theirs():
    s = _sched(slo=1.0, max_seqs=1)
    reqs = [_req("late0", 4, 0.0, 0), _req("late1", 4, 0.2, 1), _req("on0", 4, 1.5, 2), _req("on1", 4, 1.6, 3)]
    for r in reqs:
        s.add(r)
    order = []
    now = 2.0
    while s.has_unfinished():
        got = _admitted(s, now)
        order += got
        for r in list(s.running):
            s.finish(r, "stop")
        now += 0.01
    assert order == ["on0", "on1", "late0", "late1"]


def test_a_preempted_request_is_never_demoted():
    s = _sched(slo=1.0, max_seqs=1)
    back = _req("back", 8, arrival=0.0, seq=0)
    back.append_token(7)  # it had its first token before it was preempted
    s.add(back)
    s.add(_req("new", 8, arrival=4.5, seq=1))
    assert _admitted(s, now=5.0) == ["back"]


def test_late_requests_count_in_the_queued_prefill_and_aborts_leave_no_trace():
    s = _sched(slo=1.0, max_seqs=1)
    late, gone, on = _req("late", 8, 0.0, 0), _req("gone", 12, 0.1, 1), _req("on", 4, 1.8, 2)
    for r in (late, gone, on):
        s.add(r)
    assert _admitted(s, now=2.0) == ["on"]
    assert s.queued_prefill_tokens == 8 + 12
    s.finish(gone, "abort")  # waiting, already moved aside as late
    s.finish(on, "stop")
    assert _admitted(s, now=2.1) == ["late"]
    s.finish(late, "stop")
    assert not s.has_unfinished() and s.num_waiting == 0 and gone.status is RequestStatus.FINISHED
    s.kv.check_integrity()


def test_refuses_a_negative_or_nan_target():
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="ttft_slo_s"):
            _sched(slo=bad)
