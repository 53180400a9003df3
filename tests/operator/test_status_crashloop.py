"""A crash-looping pool is Degraded from its pods' container statuses, long before the
Deployment's progress deadline."""

from kvmesh.operator.reconcile import KubeOps, Reconciler
from kvmesh.operator.status import CRASH_RESTARTS, compute_status, crash_looping

from tests.support.crs import make_cr
from .status_objects import T0, all_ready, cond, dep


def pod(name, restarts=0, waiting=None, ready=False, last_exit=None, deleting=False, init=False):
    status = {"name": "engine", "restartCount": restarts, "ready": ready,
              "state": {"waiting": {"reason": waiting}} if waiting else {"running": {}}}
    if last_exit is not None:
        status["lastState"] = {"terminated": {"exitCode": last_exit, "reason": "Error"}}
    meta = {"name": name, **({"deletionTimestamp": T0} if deleting else {})}
    key = "initContainerStatuses" if init else "containerStatuses"
    return {"metadata": meta, "status": {key: [status]}}


def test_crash_loop_back_off_is_crash_looping_at_once():
    lines = crash_looping([pod("llm-decode-a", restarts=1, waiting="CrashLoopBackOff", last_exit=1)])
    assert lines == ["llm-decode-a/engine: CrashLoopBackOff, 1 restarts, last exit 1 (Error)"]


def test_restarts_count_only_while_the_container_is_not_ready():
    assert crash_looping([pod("a", restarts=CRASH_RESTARTS - 1)]) == []
    assert crash_looping([pod("a", restarts=CRASH_RESTARTS)]) == ["a/engine: restarting, 3 restarts"]
    # It crashed a few times and then came up: it serves, so the pool is not degraded.
    assert crash_looping([pod("a", restarts=10, ready=True)]) == []


def test_terminating_pods_are_ignored_and_init_containers_count():
    assert crash_looping([pod("a", waiting="CrashLoopBackOff", deleting=True)]) == []
    assert crash_looping([pod("a", waiting="CrashLoopBackOff", init=True)]) == [
        "a/engine: CrashLoopBackOff, 0 restarts"]


def test_a_crash_looping_pool_degrades_before_the_progress_deadline():
    deps = all_ready()
    deps["decode"] = dep(2, ready=1)  # no ProgressDeadlineExceeded yet: the rollout is young
    pods = {"decode": [pod("llm-decode-a", ready=True),
                       pod("llm-decode-b", restarts=4, waiting="CrashLoopBackOff", last_exit=137)]}
    assert cond(compute_status(make_cr(), deps, T0), "Degraded")["status"] == "False"
    d = cond(compute_status(make_cr(), deps, T0, pods=pods), "Degraded")
    assert (d["status"], d["reason"]) == ("True", "CrashLoopBackOff")
    assert d["message"] == "decode: llm-decode-b/engine: CrashLoopBackOff, 4 restarts, last exit 137 (Error)"
    # Healthy pods: not degraded.
    ok = compute_status(make_cr(), all_ready(), T0, pods={"decode": [pod("x", ready=True)]})
    assert cond(ok, "Degraded")["status"] == "False"


def test_an_operator_error_still_takes_precedence():
    pods = {"decode": [pod("b", waiting="CrashLoopBackOff")]}
    st = compute_status(make_cr(), all_ready(), T0, error="forbidden", pods=pods)
    assert cond(st, "Degraded")["reason"] == "ApplyFailed"


def test_the_reconciler_reads_the_pods_when_it_can():
    obj = make_cr()
    written = []
    ops = KubeOps(get=lambda ns, name: obj, apply=lambda m: None,
                  deployments=lambda ns, name, uid: all_ready(),
                  patch_status=lambda ns, name, st: written.append(st), create_if_absent=lambda m: None,
                  pods=lambda ns, name: {"router": [pod("llm-router-a", waiting="CrashLoopBackOff")]})
    st = Reconciler(ops, now=lambda: T0).reconcile("serving", "llm")
    assert cond(st, "Degraded")["reason"] == "CrashLoopBackOff" and written
