"""The image installs kvmesh from its sources (not editable, unlike the development venv), so a
package directory missing from pyproject.toml's list works in every local test and is absent
from the image, where the engine then fails at start. Nothing runs here: pure file checks."""

from __future__ import annotations

import tomllib

from .helpers import ROOT


def test_every_package_directory_is_listed_in_pyproject():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    found = set()
    for name, directory in tool["package-dir"].items():
        for init in (ROOT / directory).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / directory)
            if "__pycache__" not in rel.parts:
                found.add(".".join([name, *rel.parts]))
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
