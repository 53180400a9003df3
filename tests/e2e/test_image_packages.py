"""The image installs kvmesh from its sources (not editable, unlike the development venv), so a
package directory missing from pyproject.toml's list works in every local test and is absent
from the image, where the engine then fails at start. Nothing runs here: pure file checks."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

from .helpers import ROOT


def test_every_package_directory_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    # The package is the tree under kvmesh/, its links to engine/ and operator/ followed.
    for dirpath, dirnames, filenames in os.walk(ROOT / "kvmesh", followlinks=True):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        if any(f.endswith((".py", ".c")) for f in filenames):
            found.add(".".join(Path(dirpath).relative_to(ROOT).parts))
    assert "kvmesh.engine.kv" in found and "kvmesh.operator" in found, found
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
