import asyncio
from datetime import datetime, timedelta, timezone

from kvmesh.operator.leader import (
    LeaseConflict,
    LeaseElector,
    LeaseRecord,
    decide,
    lease_spec,
    record_from_lease,
)

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)


def test_free_lease_is_acquired():
    d = decide(None, "a", NOW, 15)
    assert d.action == "acquire" and d.record.holder == "a" and d.record.transitions == 0


def test_live_lease_of_another_holder_means_wait():
    held = LeaseRecord("b", NOW - timedelta(seconds=5), 15, 3)
    assert decide(held, "a", NOW, 15).action == "wait"


def test_expired_lease_is_taken_over_and_counts_a_transition():
    held = LeaseRecord("b", NOW - timedelta(seconds=16), 15, 3)
    d = decide(held, "a", NOW, 15)
    assert d.action == "acquire" and d.record.transitions == 4 and d.record.acquire_time == NOW


def test_holder_renews_keeping_acquire_time():
    acquired = NOW - timedelta(minutes=5)
    d = decide(LeaseRecord("a", NOW - timedelta(seconds=2), 15, 1, acquired), "a", NOW, 15)
    assert d.action == "renew" and d.record.renew_time == NOW and d.record.acquire_time == acquired


def test_released_lease_is_free():
    assert decide(LeaseRecord(None, NOW, 1, 2), "a", NOW, 15).action == "acquire"


def test_lease_spec_round_trip():
    rec = LeaseRecord("a", NOW, 15, 2, NOW)
    assert record_from_lease(lease_spec(rec)) == rec


class MemoryStore:
    """A Lease with resourceVersion checks, like the API server's."""

    namespace, name = "ns", "lease"

    def __init__(self):
        self.record, self.rv = None, 0

    def read(self):
        return self.record, (str(self.rv) if self.record else None)

    def write(self, record, rv):
        if (rv is None and self.record is not None) or (rv is not None and rv != str(self.rv)):
            raise LeaseConflict("conflict")
        self.record, self.rv = record, self.rv + 1


def test_two_electors_never_lead_together_and_release_hands_over():
    store = MemoryStore()
    clock = [NOW]
    a = LeaseElector(store, "a", 15, 10, 0.01, clock=lambda: clock[0])
    b = LeaseElector(store, "b", 15, 10, 0.01, clock=lambda: clock[0])

    async def scenario():
        await a.acquire()
        b_task = asyncio.create_task(b.acquire())
        await asyncio.sleep(0.1)
        assert a.is_leader and not b.is_leader and not b_task.done()
        a.release()
        await asyncio.wait_for(b_task, 2)
        assert b.is_leader and not a.is_leader and store.record.holder == "b"

    asyncio.run(scenario())


def test_leader_that_cannot_renew_steps_down():
    class Broken(MemoryStore):
        def write(self, record, rv):
            raise OSError("apiserver unreachable")

    store = Broken()
    store.record, store.rv = LeaseRecord("a", NOW, 15, 0, NOW), 1
    elector = LeaseElector(store, "a", 15, 0.05, 0.01, clock=lambda: NOW)
    elector.is_leader = True
    asyncio.run(asyncio.wait_for(elector.hold(), 2))
    assert not elector.is_leader
