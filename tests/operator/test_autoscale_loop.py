"""The autoscaler's control loop against a fake metric source and fake cluster."""

from kvmesh.operator.autoscale_loop import AutoscaleRunner
from kvmesh.operator.scaling import PodInfo

from .autoscale_fakes import Fakes, cr


def test_scale_up_records_the_choice_in_status_then_reconciles_and_reports():
    obj = cr()
    f = Fakes(obj, kv=1.0)
    runner = AutoscaleRunner(f, f.io())
    decisions = runner.tick(obj, now=1000.0)
    assert decisions["decode"].desired == 3
    assert obj["status"]["autoscaling"]["decode"]["desiredReplicas"] == 3
    assert f.applies == ["llm"] and f.events == ["ScaledUp"]
    slo = [c for c in obj["status"]["conditions"] if c["type"] == "SLOMet"][0]
    assert slo["status"] == "True" and "TPOT p95 20ms / SLO 50ms" in slo["message"]


def test_scale_down_drains_first_and_lowers_replicas_only_when_drained():
    obj = cr()
    f = Fakes(obj, kv=0.05)
    runner = AutoscaleRunner(f, f.io())
    runner.tick(obj, now=1000.0)
    assert f.drained == ["llm-decode-x-b"] and f.applies == []
    assert obj["status"]["autoscaling"]["decode"]["drainingPod"] == "llm-decode-x-b"
    f.in_flight_left = 1
    runner.tick(obj, now=1010.0)
    assert f.applies == []  # still a request in flight on the victim
    f.in_flight_left = 0
    runner.tick(obj, now=1020.0)
    assert f.marked == ["llm-decode-x-b"] and f.applies == ["llm"]
    assert obj["status"]["autoscaling"]["decode"]["desiredReplicas"] == 1
    assert f.events == ["DrainingPod", "ScaledDown"]


def test_an_operator_restarted_mid_drain_resumes_it_from_the_pods_record():
    obj = cr()
    f = Fakes(obj, kv=0.05)
    f.in_flight_left = 1
    AutoscaleRunner(f, f.io()).tick(obj, now=1000.0)
    assert f.drained == ["llm-decode-x-b"] and f.records.keys() == {"llm-decode-x-b"}
    f.pods["decode"] = f.pods["decode"][:1]  # the drained pod is no longer ready

    successor = AutoscaleRunner(f, f.io())  # a new leader: nothing in memory
    successor.tick(obj, now=1010.0)
    assert f.events == ["DrainingPod", "DrainResumed"]
    assert obj["status"]["autoscaling"]["decode"]["drainingPod"] == "llm-decode-x-b"
    assert "desiredReplicas" not in obj["status"]["autoscaling"]["decode"]
    f.in_flight_left = 0
    successor.tick(obj, now=1020.0)
    assert f.marked == ["llm-decode-x-b"] and f.applies == ["llm"] and f.events[-1] == "ScaledDown"
    assert obj["status"]["autoscaling"]["decode"]["desiredReplicas"] == 1


def test_an_unchanged_decision_writes_no_status():
    obj = cr(up=300)
    f = Fakes(obj, kv=0.5)
    runner = AutoscaleRunner(f, f.io())
    runner.tick(obj, now=1000.0)
    writes = len(f.patches)
    runner.tick(obj, now=1015.0)
    assert len(f.patches) == writes


def test_a_disaggregated_deployments_pools_are_sampled_with_the_routers_pods():
    obj = cr()  # prefill.replicas 1: disaggregated
    f = Fakes(obj, kv=0.5)
    f.pods["prefill"] = [PodInfo("llm-prefill-x-a", "10.0.1.1:8000", 0)]
    targets = []
    sample = f.sample
    f.sample = lambda target, now: targets.append(target) or sample(target, now)
    io = f.io()
    io.router_endpoints = lambda ns, name: ("10.0.2.1:8000",)
    AutoscaleRunner(f, io).tick(obj, now=1000.0)
    assert {t.component for t in targets} == {"prefill", "decode"}
    assert all(t.disaggregated and t.routers == ("10.0.2.1:8000",) for t in targets)
    assert {t.endpoints for t in targets} == {("10.0.1.1:8000",), ("10.0.0.1:8000", "10.0.0.2:8000")}

    colocated = cr()
    colocated["spec"]["prefill"] = {"replicas": 0}
    targets.clear()
    AutoscaleRunner(f, io).tick(colocated, now=1000.0)  # routers known, but not read when colocated
    assert [(t.component, t.disaggregated, t.routers) for t in targets] == [("decode", False, ())]


def test_the_routers_readiness_becomes_the_cache_aware_routing_condition():
    obj = cr(up=300)
    f = Fakes(obj, kv=0.5)
    io = f.io()
    io.router_readiness = lambda ns, name: [("llm-router-x", {"ready": False, "tokenizer": None,
                                                             "tokenizer_problem": "no engine asked yet",
                                                             "mismatches": {}})]
    AutoscaleRunner(f, io).tick(obj, now=1000.0)
    (routing,) = [c for c in obj["status"]["conditions"] if c["type"] == "CacheAwareRouting"]
    assert (routing["status"], routing["reason"]) == ("False", "NoTokenizer")
    assert "no engine asked yet" in routing["message"]
    assert [c["type"] for c in obj["status"]["conditions"]].count("CacheAwareRouting") == 1
