"""Where kvmesh keeps what it downloads or builds on first use (models, compiled kernels)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def default_cache_dir() -> Path:
    """`$KVMESH_CACHE_DIR` if set, else `~/.cache/kvmesh`."""
    env = os.environ.get("KVMESH_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvmesh"


@contextmanager
def building(target: Path) -> Iterator[Path]:
    """The path to write ``target``'s new content to, in a scratch directory beside it; moved onto
    ``target`` in one rename when the block ends without an error, so concurrent builders never
    load a partial file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        yield out
        os.replace(out, target)
