"""Drain-before-scale-down sequencing against a fake cluster and fake engines."""

from kvmesh.operator.autoscaler import Decision
from kvmesh.operator.scaling import PodInfo, PoolScaler


class FakeCluster:
    def __init__(self, in_flight):
        self.in_flight_by_pod = dict(in_flight)  # pod -> in-flight requests (None: not answering)
        self.replicas = len(in_flight)
        self.drained: list[str] = []
        self.marked: list[str] = []
        self.calls: list[str] = []
        self.events: list[tuple[str, str]] = []
        self.records: dict[str, str] = {}  # pod -> its DRAIN_ANNOTATION
        self.renewals = 0

    def ready_pods(self, pool):
        return [PodInfo(n, f"{n}:8000", v) for n, v in self.in_flight_by_pod.items()
                if n not in self.drained]

    def start_drain(self, pod):
        if pod.name in self.drained:  # asked again: the lease is renewed
            self.renewals += 1
            return
        self.drained.append(pod.name)
        self.calls.append(f"drain {pod.name}")

    def is_draining(self, pod):
        return (pod.name in self.drained) if pod.name in self.in_flight_by_pod else None

    def record_drain(self, pool, pod, record):
        if record is None:
            self.records.pop(pod.name, None)
            self.calls.append(f"unrecord {pod.name}")
        else:
            self.records[pod.name] = record
            self.calls.append(f"record {pod.name}")

    def recorded_drains(self, pool):
        return [(PodInfo(n, f"{n}:8000", None), v) for n, v in self.records.items()]

    def cancel_drain(self, pod):
        self.drained.remove(pod.name)
        self.calls.append(f"undrain {pod.name}")

    def in_flight(self, pod):
        return self.in_flight_by_pod.get(pod.name)

    def mark_for_deletion(self, pool, pod):
        self.marked.append(pod.name)
        self.calls.append(f"mark {pod.name}")

    def set_replicas(self, pool, n):
        self.replicas = n
        self.calls.append(f"replicas {n}")

    def event(self, pool, reason, message):
        self.events.append((reason, message))


def decision(current, desired, reason="UnderUtilized"):
    return Decision("decode", current, desired, reason, "KV occupancy 0.10 / target 0.80", 0.0)


def test_scale_down_drains_the_least_loaded_pod_then_removes_exactly_it():
    fake = FakeCluster({"a": 3, "b": 1, "c": 2})
    s = PoolScaler("decode", fake, grace_s=300)
    assert s.step(decision(3, 2), now=0) == "drain-started"
    assert fake.calls == ["record b", "drain b"] and fake.replicas == 3
    assert s.step(decision(3, 2), now=10) == "draining"  # b still has a request
    fake.in_flight_by_pod["b"] = 0
    assert s.step(decision(3, 2), now=20) == "drained"
    # Marked with the lowest deletion cost before replicas go down: the ReplicaSet takes b.
    assert fake.calls == ["record b", "drain b", "mark b", "replicas 2"]
    assert fake.renewals == 2  # the lease is renewed on each tick of the drain
    assert [r for r, _ in fake.events] == ["DrainingPod", "ScaledDown"]
    assert "removed b (drained in 20s)" in fake.events[-1][1]


def test_one_drain_at_a_time_and_the_wait_is_bounded_by_the_grace_period():
    fake = FakeCluster({"a": 5, "b": 4})
    s = PoolScaler("decode", fake, grace_s=60)
    s.step(decision(2, 1), now=0)
    assert s.step(decision(2, 1), now=30) == "draining"
    assert fake.calls == ["record b", "drain b"]  # no second drain while the first runs
    assert s.step(decision(2, 1), now=61) == "drain-timed-out"
    assert fake.replicas == 1 and fake.marked == ["b"]
    assert "4 request(s) still in flight after 60s" in fake.events[-1][1]


def test_a_pod_that_vanished_while_draining_still_completes_the_scale_down():
    fake = FakeCluster({"a": 0, "b": 2})
    s = PoolScaler("decode", fake, grace_s=300)
    s.step(decision(2, 1), now=0)
    del fake.in_flight_by_pod["a"]
    assert s.step(decision(2, 1), now=5) == "drained" and fake.replicas == 1


def test_pods_that_do_not_answer_are_drained_last():
    fake = FakeCluster({"a": None, "b": 7})
    PoolScaler("decode", fake, grace_s=300).step(decision(2, 1), now=0)
    assert fake.drained == ["b"]


def test_scale_up_is_immediate_and_hold_does_nothing():
    fake = FakeCluster({"a": 1})
    s = PoolScaler("decode", fake, grace_s=300)
    assert s.step(decision(1, 3, "KVOccupancyHigh"), now=0) == "scaled-up"
    assert fake.replicas == 3 and fake.events[0][0] == "ScaledUp"
    assert s.step(decision(3, 3, "WithinTarget"), now=1) == "hold"
    assert fake.calls == ["replicas 3"]


def test_a_scale_up_during_a_drain_cancels_it_and_nothing_undrained_is_removed():
    """Seen before: 4 replicas, a drain starts (target 3), a spike writes 6, and the drain's end
    wrote the 3 fixed at its start, removing three pods at once, two of them serving."""
    fake = FakeCluster({"a": 2, "b": 1, "c": 3, "d": 4})
    s = PoolScaler("decode", fake, grace_s=300)
    assert s.step(decision(4, 3), now=0) == "drain-started"
    assert s.step(decision(4, 6, reason="KVPressure"), now=5) == "drain-cancelled"
    assert fake.calls == ["record b", "drain b", "undrain b", "unrecord b", "replicas 6"]
    assert fake.drained == [] and fake.marked == [] and fake.records == {}
    assert fake.events[-1][0] == "DrainCancelled" and "b serves again" in fake.events[-1][1]
    assert s.draining is None
    # Later scale-downs go one pod at a time from the replicas the pool has then.
    fake.in_flight_by_pod.update({"e": 5, "f": 6})
    assert s.step(decision(6, 3), now=60) == "drain-started"
    fake.in_flight_by_pod["b"] = 0
    assert s.step(decision(6, 3), now=70) == "drained"
    assert fake.calls[-2:] == ["mark b", "replicas 5"]


def test_a_drain_ends_one_below_the_replicas_the_pool_has_then():
    fake = FakeCluster({"a": 1, "b": 2})
    s = PoolScaler("decode", fake, grace_s=300)
    assert s.step(decision(2, 1), now=0) == "drain-started"
    assert s.step(decision(3, 3), now=5) == "draining"  # someone raised replicas by hand meanwhile
    fake.in_flight_by_pod["a"] = 0
    assert s.step(decision(3, 1), now=10) == "drained"
    assert fake.calls[-1] == "replicas 2"  # one pod fewer than now, never the count fixed at the start


def test_a_victim_that_cannot_be_undrained_does_not_stop_the_scale_up():
    fake = FakeCluster({"a": 0, "b": 1})

    def gone(pod):
        raise RuntimeError("connection refused")

    fake.cancel_drain = gone
    s = PoolScaler("decode", fake, grace_s=300)
    s.step(decision(2, 1), now=0)
    assert s.step(decision(2, 4), now=1) == "drain-cancelled"
    assert fake.replicas == 4 and "could not undrain a" in fake.events[-1][1]


def test_a_drain_is_recorded_on_its_pod_before_the_engine_is_asked_and_dropped_when_that_fails():
    class Refusing(FakeCluster):
        def start_drain(self, pod):
            raise RuntimeError("engine gone")

    fake = Refusing({"a": 1, "b": 0})
    s = PoolScaler("decode", fake, grace_s=300)
    try:
        s.step(decision(2, 1), now=0)
    except RuntimeError:
        pass
    assert fake.calls == ["record b", "unrecord b"] and s.draining is None and fake.records == {}


def test_a_new_operator_resumes_a_recorded_drain_whose_engine_still_drains():
    """The operator that started the drain died; its successor finds the record on the pod."""
    fake = FakeCluster({"a": 2, "b": 1})
    PoolScaler("decode", fake, grace_s=300).step(decision(2, 1), now=100)
    assert fake.records.keys() == {"b"} and fake.drained == ["b"]

    successor = PoolScaler("decode", fake, grace_s=300)  # nothing in memory
    assert successor.adopt() == "drain-resumed"
    assert successor.draining.pod.name == "b" and successor.draining.started == 100
    assert successor.draining.deadline == 400  # the bound the first operator set, not a new one
    # A decision of "hold" (the successor still observes) finishes the drain it resumed.
    assert successor.step(decision(2, 2), now=130) == "draining"
    fake.in_flight_by_pod["b"] = 0
    assert successor.step(decision(2, 2), now=140) == "drained"
    assert fake.replicas == 1 and fake.marked == ["b"]
    assert [r for r, _ in fake.events] == ["DrainingPod", "DrainResumed", "ScaledDown"]


def test_a_new_operator_undoes_records_whose_engine_serves_again_and_all_but_one_drain():
    fake = FakeCluster({"a": 0, "b": 0, "c": 0})
    fake.records = {"a": '{"deadline": 400, "started": 100}', "b": '{"deadline": 350, "started": 50}',
                    "c": "not json"}
    fake.drained = ["a", "b"]  # c's engine serves again (its lease ran out)
    s = PoolScaler("decode", fake, grace_s=300)
    assert s.adopt() == "drain-resumed"
    assert s.draining.pod.name == "b"  # the oldest drain that still runs
    assert fake.drained == ["b"] and fake.records.keys() == {"b"}
    assert [r for r, _ in fake.events] == ["DrainResumed", "DrainUndone", "DrainUndone"]
    assert "another drain is resumed" in fake.events[1][1] and "its record is unreadable" in fake.events[2][1]


def test_a_scale_up_right_after_adoption_cancels_the_resumed_drain():
    fake = FakeCluster({"a": 3, "b": 1})
    PoolScaler("decode", fake, grace_s=300).step(decision(2, 1), now=0)
    s = PoolScaler("decode", fake, grace_s=300)
    s.adopt()
    assert s.step(decision(2, 3, reason="KVPressure"), now=5) == "drain-cancelled"
    assert fake.drained == [] and fake.records == {} and fake.replicas == 3


def test_nothing_recorded_nothing_adopted():
    fake = FakeCluster({"a": 3})
    assert PoolScaler("decode", fake, grace_s=300).adopt() is None and fake.calls == []
