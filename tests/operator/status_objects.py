"""Deployment objects as the apiserver reports them, and condition lookup, for the status tests."""

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z"
DESIRED = {"prefill": 1, "decode": 2, "cache": 1, "router": 1}


def dep(replicas, ready=None, updated=None, generation=1, observed=1, spec_replicas=None,
        conditions=()):
    ready = replicas if ready is None else ready
    return {
        "metadata": {"generation": generation},
        "spec": {"replicas": replicas if spec_replicas is None else spec_replicas},
        "status": {
            "observedGeneration": observed,
            "replicas": replicas,
            "updatedReplicas": replicas if updated is None else updated,
            "readyReplicas": ready,
            "availableReplicas": ready,
            "conditions": list(conditions),
        },
    }


def all_ready():
    return {c: dep(n) for c, n in DESIRED.items()}


def cond(status, ctype):
    return next(c for c in status["conditions"] if c["type"] == ctype)
