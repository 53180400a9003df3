"""Every role's rendered command line (engine/util/fleet_args.py, used by `kvmesh up` and the
operator) parses with the real `kvmesh` CLI into the settings it was rendered from."""

from __future__ import annotations

import pytest

from kvmesh.cli import build_parser
from kvmesh.engine.cachenode.cli import settings_from_args as node_settings
from kvmesh.engine.router.cli import settings_from_args as router_settings
from kvmesh.engine.server.cli import settings_from_args as serve_settings
from kvmesh.engine.util import fleet_args as fa


def test_an_engine_line_with_every_field_gives_those_settings(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    line = fa.EngineLine(role="decode", model="llm", host="0.0.0.0", port=8100, model_path=str(model),
                         model_format="gguf", dtype="float32", cache_node="llm-cache.ns.svc:8000",
                         cpu_kv_bytes="2GiB", kv_cache_bytes="512MiB", num_threads=3, kv_events_port=5557,
                         kv_transfer_port=8001, drain_timeout_s=110, extra=("--max-num-seqs", "7"))
    s = serve_settings(build_parser().parse_args(fa.serve_args(line)))
    e = s.engine
    assert (s.role, s.host, s.port, s.kv_events_port, s.kv_transfer_port, s.drain_timeout_s) == (
        "decode", "0.0.0.0", 8100, 5557, 8001, 110.0)
    assert (e.model, e.dtype, e.cache_node, e.cpu_kv_bytes, e.kv_cache_bytes, e.num_threads, e.max_num_seqs) == (
        str(model), "float32", "llm-cache.ns.svc:8000", 2 << 30, 512 << 20, 3, 7)
    assert s.served_model_names == ["llm"]


def test_a_router_line_takes_urls_or_services_for_each_pool():
    urls = fa.RouterLine(decode=fa.Pool(urls=("http://127.0.0.1:8101",)),
                         prefill=fa.Pool(urls=("http://127.0.0.1:8100",)), port=9000, policy="least-load")
    s = router_settings(build_parser().parse_args(fa.router_args(urls)))
    assert (s.engines, s.prefill_engines, s.policy, s.disaggregated) == (
        ("http://127.0.0.1:8101",), ("http://127.0.0.1:8100",), "least-load", True)
    services = fa.RouterLine(decode=fa.Pool(service="llm-decode.ns.svc:8000"), cache_node="llm-cache.ns.svc:8000")
    args = build_parser().parse_args(fa.router_args(services))
    s = router_settings(args)
    assert [f"{x.host}:{x.port}" for x in s.services] == ["llm-decode.ns.svc:8000"] and not s.disaggregated
    assert args.cache_node == "llm-cache.ns.svc:8000"
    with pytest.raises(ValueError):
        fa.router_args(fa.RouterLine(decode=fa.Pool()))


def test_a_cache_node_line_gives_its_ports_and_memory():
    s = node_settings(build_parser().parse_args(fa.cache_node_args(fa.CacheNodeLine("1GiB", port=8090, ucx_port=8091))))
    assert (s.memory, s.port, s.ucx_port) == (1 << 30, 8090, 8091)


@pytest.mark.parametrize("admission,fields", [
    ("FirstCome", {}),
    ("TTFTFirst", {"ttft_slo_ms": 800.0}),
    ("TPOTGated", {"ttft_slo_ms": 800.0, "admission_tpot_ms": 60.0}),  # the gate at 75% of the target
])
def test_an_admission_becomes_engine_flags_that_serve_reads(admission, fields):
    """The one admission vocabulary of the operator and `kvmesh up`: each name's flags, parsed by
    the real `kvmesh serve` into its engine configuration."""
    assert fa.admission_fields(admission, 800, 80) == fields
    line = fa.EngineLine(**fa.admission_fields(admission, 800, 80))
    e = serve_settings(build_parser().parse_args(fa.serve_args(line))).engine
    assert e.ttft_slo_ms == fields.get("ttft_slo_ms", 0.0)
    assert e.admission_tpot_ms == fields.get("admission_tpot_ms", 0.0)
    e.validate()


@pytest.mark.parametrize("admission,ttft,tpot,missing", [
    ("TTFTFirst", None, 80, ("ttft",)),
    ("TPOTGated", 800, None, ("tpot",)),
    ("TPOTGated", None, None, ("ttft", "tpot")),
    ("FirstCome", None, None, ()),
])
def test_an_admission_without_its_targets_names_what_is_missing(admission, ttft, tpot, missing):
    assert fa.missing_targets(admission, ttft, tpot) == missing
    if missing:
        with pytest.raises(fa.AdmissionError) as e:
            fa.admission_fields(admission, ttft, tpot)
        assert e.value.missing == missing


def test_an_unknown_admission_is_refused():
    with pytest.raises(fa.AdmissionError, match="FirstCome, TTFTFirst, TPOTGated"):
        fa.missing_targets("Fastest", 1, 1)
