"""The fleet benchmark's kvmesh variants (bench/fleet.py) against the real `kvmesh serve` parser:
each suffix of a system name renders a flag the server takes, into the engine setting it names."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))

import fleet  # noqa: E402

from kvmesh.engine.server.cli import add_serve_arguments, settings_from_args  # noqa: E402


def test_suffixes_split_off_in_order():
    assert fleet.split_variants("cache-aware-ttft-gated") == ("cache-aware", ["ttft", "gated"])
    assert fleet.split_variants("round-robin-paced") == ("round-robin", ["paced"])
    assert fleet.split_variants("cache-aware") == ("cache-aware", [])


def test_every_variant_renders_a_flag_kvmesh_serve_takes():
    args = argparse.Namespace(slo_tpot_ms=100.0, slo_ttft_s=1.0)
    argv = []
    for _, flag, target_ms in fleet.VARIANTS.values():
        argv += [flag, str(target_ms(args))]
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    engine = settings_from_args(p.parse_args(argv)).engine.validate()
    assert (engine.tpot_slo_ms, engine.ttft_slo_ms, engine.admission_tpot_ms) == (100.0, 1000.0, 75.0)
