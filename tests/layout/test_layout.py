"""The tree's shape: import contracts, no cycles between subpackages, no stdlib shadowing.

Real: import-linter on the whole source tree (scripts/lint-imports), grimp's import graph, and a
fresh interpreter started in the repository root.
"""

from __future__ import annotations

import json
import os
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


def _lint(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(ROOT / "scripts" / "lint-imports"), *args], capture_output=True, text=True,
                          timeout=240, env={**os.environ, "KVMESH_VENV": str(Path(sys.executable).parents[1])})


def test_import_contracts_hold():
    proc = _lint()
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def test_no_import_cycles_between_subpackages(tmp_path):
    # The same source copy lint-imports checks, built here so grimp sees one package tree.
    tree = tmp_path / "kvmesh"
    tree.mkdir()
    for src in [*ROOT.joinpath("kvmesh").glob("*.py"), *ROOT.joinpath("engine").rglob("*.py"),
                *ROOT.joinpath("operator").rglob("*.py")]:
        rel = src.relative_to(ROOT)
        dst = tree / (rel if rel.parts[0] != "kvmesh" else rel.relative_to("kvmesh"))
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(src.read_bytes())
    for d in (tree, tree / "engine", tree / "operator"):
        (d / "__init__.py").touch()
    proc = subprocess.run([sys.executable, "-c", _CYCLES], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout) == []


def test_python_started_in_the_repository_root_gets_the_standard_library():
    code = "import json, operator, openai; print(operator.__file__)"
    for argv in ([sys.executable, "-c", code], [sys.executable, "-m", "json.tool", "--help"]):
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True).stdout
    assert not out.strip().startswith(str(ROOT)), out
