"""The tree's shape: import contracts, no cycles between subpackages, no stdlib shadowing.

Real: the `lint-imports` command on the repository (the contracts of pyproject.toml), grimp's
import graph of the installed package, and a fresh interpreter started in the repository root.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)

# Squashes the graph to subpackages (kvmesh.engine.kv, ...) and top modules, then looks for cycles.
_CYCLES = r"""
import json, grimp, itertools
g = grimp.build_graph("kvmesh")
def unit(m):
    parts = m.split(".")
    if parts[:2] == ["kvmesh", "engine"] and len(parts) > 2:
        return ".".join(parts[:3])
    return ".".join(parts[:2])
edges = {}
for m in g.modules:
    for dep in g.find_modules_directly_imported_by(m):
        a, b = unit(m), unit(dep)
        if a != b:
            edges.setdefault(a, set()).add(b)
cycles = []
def reach(src, dst, seen):
    for n in edges.get(src, ()):
        if n == dst:
            return [n]
        if n not in seen:
            seen.add(n)
            p = reach(n, dst, seen)
            if p:
                return [n] + p
    return None
for a in sorted(edges):
    p = reach(a, a, set())
    if p and sorted([a] + p[:-1])[0] == a:
        cycles.append([a] + p)
print(json.dumps(cycles))
"""


def test_import_contracts_hold():
    # The bare command a developer types in the repository root, from this interpreter's venv.
    lint = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def test_no_import_cycles_between_subpackages():
    proc = subprocess.run([sys.executable, "-c", _CYCLES], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout) == []


def test_the_package_is_one_tree_under_kvmesh():
    # kvmesh/engine and kvmesh/operator link the design card's top-level folders into the package.
    for name in ("engine", "operator"):
        link = ROOT / "kvmesh" / name
        assert link.is_symlink() and link.resolve() == ROOT / name, link
    for d in ("kvmesh", "engine", "operator"):
        assert not (ROOT / d / "__init__.py").exists(), f"{d}/__init__.py would make {d} a regular package"


def test_python_started_in_the_repository_root_gets_the_standard_library():
    code = "import json, operator, openai; print(operator.__file__)"
    for argv in ([sys.executable, "-c", code], [sys.executable, "-m", "json.tool", "--help"]):
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True).stdout
    assert not out.strip().startswith(str(ROOT)), out


def test_primary_kv_blocks_are_written_outside_the_forward_pass_in_two_places_only():
    # LLMEngine.write_blocks and KVTiers.flush save evicted blocks before they write (issue: a
    # host-tier copy that took bytes written after the eviction); any other writer would bypass that.
    callers = sorted(str(p.relative_to(ROOT)) for p in ROOT.joinpath("engine").rglob("*.py")
                     if "scatter_blocks(" in p.read_text())
    assert callers == ["engine/engine.py", "engine/kv/gather.py", "engine/kv/tiers.py"], callers


def test_benchmarks_never_import_the_tests():
    """bench/ measures the product: a helper it needs lives in the package or in bench/ itself
    (bench/null_engine.py), never in tests/, and nothing edits sys.path to reach tests/."""
    import re

    offenders = [f"{p.relative_to(ROOT)}:{n}" for p in sorted((ROOT / "bench").glob("*.py"))
                 for n, line in enumerate(p.read_text().splitlines(), 1)
                 if re.match(r"\s*(from|import)\s+tests\b", line) or "# tests." in line]
    assert offenders == []


# Test folders that mirror no package: shared helpers, the cluster suite, this file's, the benchmarks'.
_TEST_FOLDERS_OF_THEIR_OWN = {"support", "e2e", "layout", "bench"}


def _package_dirs() -> set[str]:
    """Every package a test folder may mirror: engine/'s subpackages, the engine core, the operator, up."""
    engine = {p.name for p in (ROOT / "engine").iterdir() if (p / "__init__.py").exists()}
    return engine | {"engine", "operator", "up"}


def test_test_folders_mirror_the_source_packages():
    folders = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders - _package_dirs() - _TEST_FOLDERS_OF_THEIR_OWN == set()
    assert sorted(p.name for p in (ROOT / "tests").glob("test_*.py")) == []  # every test lives in a folder


def test_tests_share_helpers_through_support_never_through_test_modules():
    """A helper two test modules need lives in tests/support/ (or a helper module of the folder),
    never in a test module or a conftest that another module imports."""
    import re

    pattern = re.compile(r"\s*from\s+(\S+)\s+import|\s*import\s+(\S+)")
    offenders = []
    for p in sorted((ROOT / "tests").rglob("*.py")):
        for n, line in enumerate(p.read_text().splitlines(), 1):
            m = pattern.match(line)
            if m is None:
                continue
            last = (m.group(1) or m.group(2)).rsplit(".", 1)[-1]
            if last.startswith("test_") or last == "conftest":
                offenders.append(f"{p.relative_to(ROOT)}:{n}: {line.strip()}")
    assert offenders == []
