"""The reconcile pass and its event coalescing, against in-memory fakes of the
four API operations (the real API server is exercised in tests/e2e)."""

import threading

import pytest

from kvmesh.operator.reconcile import KubeOps, Reconciler, ReconcileError

from tests.support.crs import make_cr


class FakeApi:
    def __init__(self, obj):
        self.obj = obj
        self.applied = []
        self.status_writes = []
        self.fail_kind = None
        self.deps = {}
        self.created = {}

    def ops(self):
        return KubeOps(get=self.get, apply=self.apply, deployments=self.deployments,
                       patch_status=self.patch_status, create_if_absent=self.create_if_absent,
                       apply_error=ValueError)

    def create_if_absent(self, manifest):
        key = (manifest["kind"], manifest["metadata"]["name"])
        self.created.setdefault(key, manifest)

    def get(self, ns, name):
        return self.obj

    def apply(self, manifest):
        if manifest["kind"] == self.fail_kind:
            raise ValueError(f"{manifest['kind']} {manifest['metadata']['name']}: forbidden")
        self.applied.append(manifest)

    def deployments(self, ns, name, uid):
        return self.deps

    def patch_status(self, ns, name, status):
        self.status_writes.append(status)
        self.obj = {**self.obj, "status": status}


def test_pass_applies_every_child_and_writes_status_once():
    api = FakeApi(make_cr())
    rec = Reconciler(api.ops(), now=lambda: "2026-01-01T00:00:00Z")
    rec.reconcile("serving", "llm")
    assert len(api.applied) == 10
    assert len(api.status_writes) == 1
    rec.reconcile("serving", "llm")  # nothing changed: no second status write
    assert len(api.status_writes) == 1


def test_a_pass_creates_the_auth_secret_once_with_a_random_token():
    api = FakeApi(make_cr())
    rec = Reconciler(api.ops())
    rec.reconcile("serving", "llm")
    first = api.created[("Secret", "llm-auth")]
    rec.reconcile("serving", "llm")  # create_if_absent keeps the first token (the fake, as the API does)
    assert api.created[("Secret", "llm-auth")] is first and len(first["stringData"]["token"]) >= 40
    assert not [m for m in api.applied if m["kind"] == "Secret"]  # never applied: apply would replace it
    other = FakeApi(make_cr())
    Reconciler(other.ops()).reconcile("serving", "llm")
    assert other.created[("Secret", "llm-auth")]["stringData"]["token"] != first["stringData"]["token"]


def test_failed_apply_is_reported_in_status_and_raised():
    api = FakeApi(make_cr())
    api.fail_kind = "Service"
    with pytest.raises(ReconcileError, match="forbidden"):
        Reconciler(api.ops()).reconcile("serving", "llm")
    degraded = [c for c in api.status_writes[-1]["conditions"] if c["type"] == "Degraded"][0]
    assert degraded["status"] == "True" and "Service llm-router: forbidden" in degraded["message"]
    assert len(api.applied) == 6  # the other children were still applied


def test_deleted_object_is_left_to_the_garbage_collector():
    api = FakeApi(None)
    assert Reconciler(api.ops()).reconcile("serving", "llm") is None
    api.obj = make_cr()
    api.obj["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert Reconciler(api.ops()).reconcile("serving", "llm") is None
    assert api.applied == []


def test_requests_during_a_pass_coalesce_into_one_more_pass():
    api = FakeApi(make_cr())
    rec = Reconciler(api.ops())
    entered, release = threading.Event(), threading.Event()
    passes = []
    original = rec.reconcile

    def slow(ns, name):
        passes.append(name)
        if len(passes) == 1:
            entered.set()
            release.wait(5)
        return original(ns, name)

    rec.reconcile = slow
    worker = threading.Thread(target=rec.request, args=("serving", "llm"))
    worker.start()
    assert entered.wait(5)
    folded = [rec.request("serving", "llm") for _ in range(10)]
    release.set()
    worker.join(5)
    assert folded == [False] * 10
    assert len(passes) == 2  # the running pass plus exactly one re-run
    assert rec.request("serving", "llm") is True  # idle again: runs directly
    assert len(passes) == 3


def test_resync_counts_failures_and_continues():
    good, bad = FakeApi(make_cr()), FakeApi(make_cr(name="bad"))
    bad.fail_kind = "ConfigMap"
    table = {"llm": good, "bad": bad}
    ops = KubeOps(
        get=lambda ns, name: table[name].obj,
        apply=lambda m: table[m["metadata"]["labels"]["serving.kvmesh.io/inference-deployment"]
                            ].apply(m),
        deployments=lambda ns, name, uid: {},
        patch_status=lambda ns, name, st: table[name].patch_status(ns, name, st),
        create_if_absent=lambda m: None, apply_error=ValueError,
    )
    failed = Reconciler(ops).resync([bad.obj, good.obj])
    assert failed == 1
    assert len(good.applied) == 10
