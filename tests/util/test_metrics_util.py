"""The shared Prometheus helpers."""

from __future__ import annotations

import pytest

from kvmesh.engine.util import metrics as mu


def test_names_must_carry_the_prefix_and_seconds():
    r = mu.new_registry()
    with pytest.raises(mu.MetricNameError):
        mu.gauge(r, "queue_depth", "x")
    with pytest.raises(mu.MetricNameError):
        mu.histogram(r, "kvmesh_latency_ms", "x", mu.REQUEST_LATENCY_BUCKETS)
    mu.histogram(r, "kvmesh_latency_seconds", "x", mu.REQUEST_LATENCY_BUCKETS)


def test_bucket_sets_are_sorted_seconds():
    for buckets in (mu.REQUEST_LATENCY_BUCKETS, mu.TOKEN_LATENCY_BUCKETS, mu.EVENT_LOOP_LAG_BUCKETS):
        assert list(buckets) == sorted(set(buckets)) and buckets[0] > 0


def test_callback_collector_reads_at_scrape_time():
    r = mu.new_registry()
    state = {"v": 1.0}
    r.register(mu.CallbackCollector(lambda: [mu.gauge_family("kvmesh_x", "x", state["v"], {"tier": "gpu"}),
                                             mu.counter_family("kvmesh_y_total", "y", 7)]))
    s = mu.parse_samples(mu.render(r)[0].decode())
    assert mu.sample_value(s, "kvmesh_x", tier="gpu") == 1.0
    assert mu.sample_value(s, "kvmesh_y_total") == 7.0
    state["v"] = 3.0
    assert mu.sample_value(mu.parse_samples(mu.render(r)[0].decode()), "kvmesh_x") == 3.0


def test_counter_helper_and_render_content_type():
    r = mu.new_registry()
    c = mu.counter(r, "kvmesh_things_total", "things", ("kind",))
    c.labels("a").inc(2)
    body, ctype = mu.render(r)
    assert ctype.startswith("text/plain")
    assert mu.sample_value(mu.parse_samples(body.decode()), "kvmesh_things_total", kind="a") == 2.0


def test_sample_value_refuses_ambiguity():
    s = mu.parse_samples('m{a="1"} 1\nm{a="2"} 2\n')
    assert mu.sample_value(s, "m", a="2") == 2.0
    assert mu.sample_value(s, "absent") is None
    with pytest.raises(ValueError, match="2 samples"):
        mu.sample_value(s, "m")
