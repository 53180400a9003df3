"""Where kvmesh keeps what it downloads or builds on first use (models, compiled kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """`$KVMESH_CACHE_DIR` if set, else `~/.cache/kvmesh`."""
    env = os.environ.get("KVMESH_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvmesh"
