"""A fake metric source and cluster for the autoscaler's control loop (``AutoscaleIO``), and a CR
with autoscaling on. Real: the runner, the scaler and every decision; fake: what they read and write."""

from kvmesh.operator.autoscale_loop import AutoscaleIO
from kvmesh.operator.autoscaler import PoolSample
from kvmesh.operator.scaling import PodInfo

from tests.support.crs import make_cr


class Fakes:
    def __init__(self, obj, kv):
        self.obj, self.kv = obj, kv
        self.pods = {"decode": [PodInfo("llm-decode-x-a", "10.0.0.1:8000", 2),
                                PodInfo("llm-decode-x-b", "10.0.0.2:8000", 0)]}
        self.patches, self.applies, self.events, self.drained, self.marked = [], [], [], [], []
        self.in_flight_left = 0
        self.records: dict[str, str] = {}  # pod -> its drain annotation

    def sample(self, target, now):
        n = len(target.endpoints)
        return PoolSample(t=now, pods=n, kv_occupancy=self.kv if target.component == "decode" else None,
                          tpot_s=0.02, ttft_s=0.1, queued_prefill_tokens=0.0)

    def patch_status(self, ns, name, patch):
        self.patches.append(patch)
        status = dict(self.obj.get("status") or {})
        for k, v in patch.items():
            if k == "autoscaling":
                merged = dict(status.get(k) or {})
                for pool, fields in v.items():
                    merged[pool] = {**(merged.get(pool) or {}), **fields}
                status[k] = merged
            else:
                status[k] = v
        self.obj["status"] = status

    def record_drain(self, ns, pod, record):
        if record is None:
            self.records.pop(pod.name, None)
        else:
            self.records[pod.name] = record

    def io(self):
        return AutoscaleIO(
            ready_pods=lambda ns, name, pool: self.pods.get(pool, []),
            start_drain=lambda pod: pod.name in self.drained or self.drained.append(pod.name),
            cancel_drain=lambda pod: self.drained.remove(pod.name),
            is_draining=lambda pod: pod.name in self.drained,
            record_drain=self.record_drain,
            recorded_drains=lambda ns, name, pool: [(PodInfo(n, "10.0.0.9:8000", None), v)
                                                    for n, v in self.records.items() if f"-{pool}-" in n],
            in_flight=lambda pod: self.in_flight_left,
            mark_for_deletion=lambda ns, pod: self.marked.append(pod.name),
            patch_status=self.patch_status,
            apply_replicas=lambda ns, name: self.applies.append(name),
            event=lambda obj, reason, message: self.events.append(reason))


def cr(up=0, down=0):
    spec = make_cr()["spec"]
    spec["decode"].update({"replicas": 2, "minReplicas": 1, "maxReplicas": 4})
    spec["autoscaling"] = {"enabled": True, "scaleUpStabilizationSeconds": up,
                           "scaleDownStabilizationSeconds": down}
    return make_cr(spec=spec)
