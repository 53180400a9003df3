"""Every bench script runs as `python bench/NAME.py`, which puts bench/ first on sys.path: a script
named like an installed module would be imported in its place by any library that imports that
module (bench/kernels.py once shadowed the `kernels` package transformers imports, and every bench
that loads transformers failed at start-up). Real: the installed environment's module finder."""

import sys
from importlib.machinery import PathFinder
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_no_bench_script_shadows_an_importable_module():
    # PathFinder, not importlib.util.find_spec: other tests may have imported bench scripts, and
    # find_spec answers from sys.modules first.
    path = [p for p in sys.path if p not in ("", ".") and Path(p).resolve() != BENCH]
    shadows = {}
    for script in sorted(BENCH.glob("*.py")):
        spec = PathFinder.find_spec(script.stem, path)
        if spec is not None:
            shadows[script.name] = spec.origin
    assert not shadows, f"bench scripts named like importable modules (rename them): {shadows}"
