"""The tier-and-handoff torture workload (tests/engine/torture.py): a fast variant here, a long
one behind the slow marker. Real: both engines, their pools, host tiers and handoff state, a
`kvmesh cache-node` process, and transformers as the reference."""

from __future__ import annotations

import signal

import pytest
from tests.support.processes import NodeProc
from .torture import Reference, Workload, engines, run

pytestmark = pytest.mark.timeout(1200)


@pytest.fixture
def node():
    n = NodeProc(memory="64MiB", events=False).start()
    yield n
    n.stop(signal.SIGKILL)


def _check(model_dir, loaded, node, w: Workload):  # noqa: F811
    p, d = engines(model_dir, loaded, node.http_port)
    try:
        rep = run(p, d, Reference(model_dir, w.max_new), w)
    finally:
        for e in (p, d):
            e.close()
    print(rep, f"cycles per block {rep.cycles_per_block:.2f}")
    assert rep.mismatches == [], rep.mismatches[:5]
    assert rep.requests == w.requests
    # The workload did what it is for: blocks came back from both tiers, handoffs and aborts ran.
    assert rep.host_loads > 0 and rep.node_loads > 0 and rep.node_saves > 0
    assert rep.handoffs > 0 and rep.aborted > 0
    return rep


def test_torture_fast(model_dir, loaded, node):  # noqa: F811
    _check(model_dir, loaded, node, Workload(requests=300, seed=1))


@pytest.mark.slow  # 10,000 requests through two engines and a cache node: about 100 s
def test_torture_long(model_dir, loaded, node):  # noqa: F811
    rep = _check(model_dir, loaded, node, Workload(requests=10000, seed=2))
    assert rep.cycles_per_block > 1
