from kvmesh.operator.spec import COMPONENTS
from kvmesh.operator.status import compute_status, pool_state, status_changed

from tests.support.crs import make_cr

from .status_objects import DESIRED, T0, T1, all_ready, cond, dep


def test_all_pools_ready():
    st = compute_status(make_cr(generation=3), all_ready(), T0)
    assert st["observedGeneration"] == 3
    assert st["routerURL"] == "http://llm-router.serving.svc:8000"
    assert cond(st, "Ready")["status"] == "True"
    assert cond(st, "Ready")["reason"] == "AllPoolsReady"
    assert cond(st, "Progressing")["status"] == "False"
    assert cond(st, "Degraded")["status"] == "False"
    assert st["components"]["decode"] == {
        "desiredReplicas": 2, "replicas": 2, "updatedReplicas": 2, "readyReplicas": 2,
        "availableReplicas": 2, "ready": "2/2"}
    assert all(c["observedGeneration"] == 3 for c in st["conditions"])


def test_pool_not_ready_is_named():
    deps = all_ready()
    deps["decode"] = dep(2, ready=1)
    st = compute_status(make_cr(), deps, T0)
    ready = cond(st, "Ready")
    assert ready["status"] == "False" and ready["reason"] == "PoolsNotReady"
    assert ready["message"] == "decode 1/2 ready"
    assert st["components"]["decode"]["ready"] == "1/2"


def test_scaled_spec_not_yet_observed_is_progressing_not_ready():
    deps = all_ready()
    cr = make_cr()
    cr["spec"]["decode"]["replicas"] = 4
    st = compute_status(cr, deps, T0)  # Deployment still says 2
    assert cond(st, "Ready")["status"] == "False"
    assert cond(st, "Progressing")["status"] == "True"
    deps["decode"] = dep(4, ready=4, generation=2, observed=1)  # controller lagging
    assert cond(compute_status(cr, deps, T0), "Ready")["status"] == "False"
    deps["decode"] = dep(4, ready=4, generation=2, observed=2)
    assert cond(compute_status(cr, deps, T0), "Ready")["status"] == "True"


def test_missing_child_degrades():
    deps = all_ready()
    del deps["router"]
    st = compute_status(make_cr(), deps, T0)
    assert cond(st, "Degraded")["status"] == "True"
    assert cond(st, "Degraded")["reason"] == "ChildMissing"
    assert "router" in cond(st, "Degraded")["message"]
    assert cond(st, "Ready")["status"] == "False"


def test_deadline_and_replica_failure_degrade():
    deps = all_ready()
    deps["prefill"] = dep(1, ready=0, conditions=[
        {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"}])
    assert cond(compute_status(make_cr(), deps, T0), "Degraded")["reason"] == \
        "ProgressDeadlineExceeded"
    deps = all_ready()
    deps["cache"] = dep(1, ready=0, conditions=[
        {"type": "ReplicaFailure", "status": "True", "message": "exceeded quota"}])
    degraded = cond(compute_status(make_cr(), deps, T0), "Degraded")
    assert degraded["reason"] == "ReplicaFailure" and "exceeded quota" in degraded["message"]


def test_operator_error_degrades_with_its_message():
    st = compute_status(make_cr(), all_ready(), T0, error="Deployment llm-decode: forbidden")
    d = cond(st, "Degraded")
    assert (d["status"], d["reason"], d["message"]) == (
        "True", "ApplyFailed", "Deployment llm-decode: forbidden")


def test_invalid_spec_degrades():
    st = compute_status(make_cr(spec={"model": {}}), {}, T0)
    assert cond(st, "Degraded")["reason"] == "InvalidSpec"


def test_transition_time_moves_only_on_change():
    first = compute_status(make_cr(), all_ready(), T0)
    again = compute_status(make_cr(status=first), all_ready(), T1)
    assert again == first and not status_changed(first, again)
    deps = all_ready()
    deps["decode"] = dep(2, ready=0)
    changed = compute_status(make_cr(status=first), deps, T1)
    assert cond(changed, "Ready")["lastTransitionTime"] == T1
    assert cond(changed, "Degraded")["lastTransitionTime"] == T0
    assert status_changed(first, changed)


def test_zero_replica_pool_is_ready_with_no_pods():
    cr = make_cr()
    cr["spec"]["prefill"]["replicas"] = 0
    deps = all_ready()
    deps["prefill"] = dep(0)
    assert cond(compute_status(cr, deps, T0), "Ready")["status"] == "True"


def test_pool_state_of_missing_deployment():
    p = pool_state("decode", 2, None)
    assert not p.exists and not p.is_ready
    assert set(COMPONENTS) == set(DESIRED)


def test_router_url_only_while_a_router_pod_is_ready():
    deps = all_ready()
    deps["router"] = dep(1, ready=0)
    assert compute_status(make_cr(), deps, T0)["routerURL"] is None
    spec = make_cr()["spec"]
    spec["router"]["replicas"] = 0
    deps["router"] = dep(0)
    assert compute_status(make_cr(spec=spec), deps, T0)["routerURL"] is None


def test_autoscaled_pools_are_judged_against_the_autoscalers_choice_and_slomet_is_kept():
    spec = make_cr()["spec"]
    spec["decode"].update({"minReplicas": 1, "maxReplicas": 6})
    spec["autoscaling"] = {"enabled": True}
    slo = {"type": "SLOMet", "status": "False", "reason": "TPOTAboveSLO", "message": "",
           "lastTransitionTime": T0, "observedGeneration": 1}
    obj = make_cr(spec=spec, status={"autoscaling": {"decode": {"desiredReplicas": 4}},
                                     "conditions": [slo]})
    deps = all_ready()
    deps["decode"] = dep(4)
    st = compute_status(obj, deps, T1)
    assert st["components"]["decode"]["desiredReplicas"] == 4
    assert cond(st, "Ready")["status"] == "True"
    assert cond(st, "SLOMet") == slo


def test_effective_replicas_clamp_the_autoscalers_choice_to_the_bounds():
    from kvmesh.operator.autoscaler import effective_replicas
    from kvmesh.operator.spec import parse_spec

    spec = make_cr()["spec"]
    spec["decode"].update({"minReplicas": 1, "maxReplicas": 3})
    status = {"autoscaling": {"decode": {"desiredReplicas": 9}, "prefill": {}}}
    assert effective_replicas(parse_spec(spec), status)["decode"] == 2  # autoscaling off: spec
    spec["autoscaling"] = {"enabled": True}
    got = effective_replicas(parse_spec(spec), status)
    assert (got["decode"], got["prefill"], got["cache"]) == (3, 1, 1)
