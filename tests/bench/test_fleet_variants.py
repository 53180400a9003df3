"""The fleet benchmark's kvmesh variants (bench/fleet.py) against the real `kvmesh` parser: each
suffix of a system name becomes `kvmesh up` options whose engine command lines the real `kvmesh
serve` parses into the engine settings the suffix names."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))

import fleet  # noqa: E402

from kvmesh.cli import build_parser  # noqa: E402
from kvmesh.engine.server.cli import settings_from_args  # noqa: E402
from kvmesh.up import plan  # noqa: E402


def test_suffixes_split_off_in_order():
    assert fleet.split_variants("cache-aware-ttft-gated") == ("cache-aware", ["ttft", "gated"])
    assert fleet.split_variants("round-robin-paced") == ("round-robin", ["paced"])
    assert fleet.split_variants("cache-aware") == ("cache-aware", [])


@pytest.mark.parametrize("variants,want", [
    ([], (0.0, 0.0, 0.0)),
    (["paced"], (100.0, 0.0, 0.0)),  # the prefill pacer at the TPOT target
    (["ttft"], (0.0, 1000.0, 0.0)),  # kvmesh up --admission TTFTFirst
    (["paced", "ttft", "gated"], (100.0, 1000.0, 75.0)),  # TPOTGated: the gate at 75% of the target
])
def test_every_variant_reaches_the_engines_as_kvmesh_serve_reads_it(variants, want):
    args = argparse.Namespace(slo_tpot_ms=100.0, slo_ttft_s=1.0, dtype="bfloat16", kvmesh_args="", engines=2,
                              base_port=19000, model="default", kv_cache_bytes="128MiB")
    parser = build_parser()
    engines = plan(fleet.up_options(args, "cache-aware", variants), cores=2)[:-1]
    for spec in engines:
        engine = settings_from_args(parser.parse_args(list(spec.args))).engine.validate()
        assert (engine.tpot_slo_ms, engine.ttft_slo_ms, engine.admission_tpot_ms) == want
        assert engine.dtype == "bfloat16"


def test_the_gate_alone_is_refused():
    with pytest.raises(SystemExit, match="ttft-gated"):
        fleet.admission_of(["gated"])
