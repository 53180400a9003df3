"""Admission by the time per output token (``TpotGate``), alone and inside the scheduler, without a
model. Real: the gate, the scheduler and the KV cache manager; step times are what the engine would
measure, fed in by hand."""

from __future__ import annotations

import pytest

from kvmesh.engine.block_hash import extra_key
from kvmesh.engine.config import ConfigError, EngineConfig
from kvmesh.engine.kv.kv_manager import KVCacheManager
from kvmesh.engine.outputs import RequestMetrics
from kvmesh.engine.request import Request
from kvmesh.engine.sampling import SamplingParams
from kvmesh.engine.scheduler import Scheduler
from kvmesh.engine.tpot_gate import TpotGate

BS = 4


def _req(rid: str, n: int, seq: int, max_tokens: int = 4) -> Request:
    return Request(rid, [10 * seq + 100 + i for i in range(n)], SamplingParams(max_tokens=max_tokens),
                   RequestMetrics(arrival_time=0.0), arrival_seq=seq)


def _sched(gate: TpotGate | None, max_seqs: int = 8) -> Scheduler:
    kv = KVCacheManager(256, BS, True, extra_key("m", "float32"))
    return Scheduler(kv, max_seqs, 256, gate=gate)


def _step(s: Scheduler) -> list[str]:
    """One step; the sequences that completed their prompt get a token. Returns those admitted."""
    out = s.schedule(1.0)
    s.update_after_step(out)
    for q in out.seqs:
        if q.request.num_computed_tokens == q.request.num_tokens:
            q.request.append_token(1)
    return [q.request.request_id for q in out.seqs if q.num_computed_tokens == 0]


def test_the_gate_alone():
    g = TpotGate(0.1)
    assert g.admits(0, 0) and g.admits(0, 5), "an idle engine admits"
    assert g.admits(3, 0) and not g.admits(3, 1), "one per step while others run, before anything is measured"
    g.observe(0, 5.0)  # a prefill-only step: no stream waited on it
    assert g.step_s is None
    g.observe(4, 0.2)
    assert g.step_s == pytest.approx(0.2) and not g.admits(3, 0) and g.admits(0, 0)
    for _ in range(10):
        g.observe(4, 0.05)
    assert g.step_s < 0.1 and g.admits(3, 0)
    with pytest.raises(ValueError, match="target_s"):
        TpotGate(0.0)


def test_an_idle_engine_admits_then_one_per_step():
    s = _sched(TpotGate(0.1))
    for i in range(4):
        s.add(_req(f"r{i}", 8, i))
    assert _step(s) == ["r0"]
    assert _step(s) == ["r1"]  # nothing measured yet: still one per step
    s.gate.observe(2, 0.05)
    assert _step(s) == ["r2"]


def test_slow_steps_hold_the_queue_and_fast_ones_release_it():
    s = _sched(TpotGate(0.1))
    for i in range(3):
        s.add(_req(f"r{i}", 8, i, max_tokens=50))
    assert _step(s) == ["r0"]
    s.gate.observe(1, 0.3)
    for _ in range(3):
        assert _step(s) == [], "the running stream steps on; nobody new joins it"
    assert [r.request_id for r in s.running] == ["r0"] and s.num_waiting == 2
    for _ in range(8):
        s.gate.observe(1, 0.02)
    assert _step(s) == ["r1"]


def test_a_held_queue_still_drains_once_the_running_requests_finish():
    s = _sched(TpotGate(0.1))
    s.add(_req("a", 8, 0))
    s.add(_req("b", 8, 1))
    assert _step(s) == ["a"]
    s.gate.observe(1, 10.0)
    assert _step(s) == []
    s.finish(s.running[0], "stop")
    assert _step(s) == ["b"], "the gate never idles an engine"


def test_without_a_gate_a_step_admits_all_that_fit():
    s = _sched(None)
    for i in range(4):
        s.add(_req(f"r{i}", 8, i))
    assert _step(s) == ["r0", "r1", "r2", "r3"]


def test_config_refuses_a_negative_or_nan_target():
    for bad in (-1.0, float("nan")):
        with pytest.raises(ConfigError, match="admission_tpot_ms"):
            EngineConfig(admission_tpot_ms=bad).validate()
