"""The operator's /metrics: autoscaler gauges and counters, fed by the control loop, served on the
health port."""

from __future__ import annotations

import asyncio

from kvmesh.engine.util.metrics import parse_samples, sample_value
from kvmesh.operator.autoscale_loop import AutoscaleRunner
from kvmesh.operator.autoscaler import Decision
from kvmesh.operator.health import HealthState, respond_bytes, serve_health
from kvmesh.operator.metrics import OperatorMetrics

from .autoscale_fakes import Fakes, cr

POOL = {"namespace": "serving", "inference_deployment": "llm", "component": "decode"}


def samples(m: OperatorMetrics):
    body, content_type = m.exposition()
    assert content_type.startswith("text/plain")
    return parse_samples(body.decode())


def test_gauges_follow_the_last_decision_and_counters_count_every_one():
    m = OperatorMetrics()
    m.record_decisions("serving", "llm", {
        "decode": Decision("decode", 2, 3, "KVOccupancyHigh", "", 0.0, slo_met=False),
        "prefill": Decision("prefill", 1, 1, "WithinTarget", "", 0.0)})
    m.record_decisions("serving", "llm", {
        "decode": Decision("decode", 3, 3, "ScaleDownStabilizing", "", 15.0, slo_met=True)})
    got = samples(m)
    assert sample_value(got, "kvmesh_autoscaler_desired_replicas", **POOL) == 3
    assert sample_value(got, "kvmesh_autoscaler_current_replicas", **POOL) == 3
    assert sample_value(got, "kvmesh_autoscaler_slo_met", **POOL) == 1
    assert sample_value(got, "kvmesh_autoscaler_decisions_total", **POOL, direction="up",
                        reason="KVOccupancyHigh") == 1
    assert sample_value(got, "kvmesh_autoscaler_decisions_total", **POOL, direction="hold",
                        reason="ScaleDownStabilizing") == 1
    # prefill was not in the second round (no longer autoscaled): its gauges are gone, its
    # counter stays (a counter never goes back).
    assert sample_value(got, "kvmesh_autoscaler_desired_replicas", component="prefill") is None
    assert sample_value(got, "kvmesh_autoscaler_decisions_total", component="prefill",
                        direction="hold") == 1


def test_unknown_slo_has_no_sample_and_deleted_deployments_drop_their_gauges():
    m = OperatorMetrics()
    m.record_decisions("serving", "llm", {"decode": Decision("decode", 2, 2, "NoMetrics", "", 0.0)})
    m.record_decisions("other", "x", {"decode": Decision("decode", 1, 1, "NoMetrics", "", 0.0)})
    got = samples(m)
    assert sample_value(got, "kvmesh_autoscaler_slo_met", **POOL) is None
    assert sample_value(got, "kvmesh_autoscaler_current_replicas", **POOL) == 2
    m.retain([("other", "x")])
    got = samples(m)
    assert sample_value(got, "kvmesh_autoscaler_current_replicas", **POOL) is None
    assert sample_value(got, "kvmesh_autoscaler_current_replicas", namespace="other") == 1


def test_each_operator_metrics_object_has_its_own_registry():
    a, b = OperatorMetrics(), OperatorMetrics()
    a.record_step("serving", "llm", "decode", "drain-started")
    assert sample_value(samples(b), "kvmesh_autoscaler_drains_started_total", **POOL) is None


def test_the_control_loop_counts_drains_started_finished_and_timed_out():
    obj = cr()
    f = Fakes(obj, kv=0.05)
    m = OperatorMetrics()
    runner = AutoscaleRunner(f, f.io(), metrics=m)
    runner.tick(obj, now=1000.0)  # drain starts
    got = samples(m)
    assert sample_value(got, "kvmesh_autoscaler_drains_started_total", **POOL) == 1
    assert sample_value(got, "kvmesh_autoscaler_desired_replicas", **POOL) == 1
    assert sample_value(got, "kvmesh_autoscaler_current_replicas", **POOL) == 2
    assert sample_value(got, "kvmesh_autoscaler_decisions_total", **POOL, direction="down",
                        reason="UnderUtilized") == 1
    f.in_flight_left = 0
    runner.tick(obj, now=1015.0)  # victim idle: removed
    got = samples(m)
    assert sample_value(got, "kvmesh_autoscaler_drains_finished_total", **POOL) == 1
    assert sample_value(got, "kvmesh_autoscaler_drains_timed_out_total", **POOL) == 0

    runner.retain([])
    assert sample_value(samples(m), "kvmesh_autoscaler_current_replicas", **POOL) is None


def test_a_victim_that_never_empties_counts_as_timed_out():
    obj = cr()
    f = Fakes(obj, kv=0.05)
    f.in_flight_left = 3
    m = OperatorMetrics()
    runner = AutoscaleRunner(f, f.io(), metrics=m)
    runner.tick(obj, now=1000.0)
    runner.tick(obj, now=1000.0 + 300 + 1)  # past the decode pool's default grace period
    got = samples(m)
    assert f.marked == ["llm-decode-x-b"]
    assert sample_value(got, "kvmesh_autoscaler_drains_started_total", **POOL) == 1
    assert sample_value(got, "kvmesh_autoscaler_drains_finished_total", **POOL) == 0
    assert sample_value(got, "kvmesh_autoscaler_drains_timed_out_total", **POOL) == 1


def test_metrics_are_served_on_the_health_port():
    m = OperatorMetrics()
    m.record_decisions("serving", "llm", {"decode": Decision("decode", 2, 2, "WithinTarget", "", 0.0)})
    state = HealthState("op-1", metrics=m.exposition)
    code, content_type, body = respond_bytes(state, "/metrics")
    assert code == 200 and b"kvmesh_autoscaler_current_replicas" in body
    assert respond_bytes(HealthState("op-1"), "/metrics")[0] == 404  # nothing to serve
    assert respond_bytes(state, "/healthz")[1] == "application/json"

    async def scrape() -> bytes:
        server = await serve_health(state, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            await writer.drain()
            data = await reader.read()
            writer.close()
            return data
        finally:
            server.close()
            await server.wait_closed()

    response = asyncio.run(scrape())
    head, _, payload = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"Content-Type: text/plain" in head
    assert sample_value(parse_samples(payload.decode()), "kvmesh_autoscaler_current_replicas",
                        **POOL) == 2
