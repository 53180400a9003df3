"""The real node's image store: containerd's root kept in the machine's cache between clusters.

Importing the 6.7 GB kvmesh image into a new containerd writes it twice (the content and its
unpacked layers), and `down` deletes both again: minutes of every run. The store keeps the
node's containerd root in CACHE/node-images instead, so a cluster finds what an earlier one
imported: an image whose Docker ID was imported before is not imported again, and a changed
one adds only its new layers (the old ones become unreferenced and containerd's garbage
collector drops them).

Invariants:
- at most one containerd uses the store: its owner (pid and start time, as procs records them)
  is written while the claim lock is held, and a cluster that finds the owner alive runs on a
  root of its own under its state directory, as every cluster did before;
- nothing of a cluster's pods outlives it there: `down` deletes the node's containers (their
  writable layers go with them) and a start that finds containers left by a killed cluster
  deletes them before the kubelet runs;
- `imported.json` names only images whose import completed: the entry is dropped before an
  import starts and written after it succeeded.
"""

from __future__ import annotations

import fcntl
import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from . import procs

STORE = "node-images"
# A new store costs about 13 GB for good (the image's content and its unpacked layers); below
# this much free disk a cluster keeps its images in its state directory, deleted at `down`.
MIN_FREE_BYTES_FOR_NEW_STORE = 40 << 30


@contextmanager
def claim(cache_dir: Path) -> Iterator[Path | None]:
    """The store's root, or None when a live containerd owns it (or the disk is too full for a
    new one). The claim lock is held while the block runs: start containerd in it, then `own`."""
    root = cache_dir / STORE / "root"
    if not root.exists() and shutil.disk_usage(cache_dir).free < MIN_FREE_BYTES_FOR_NEW_STORE:
        yield None
        return
    root.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / STORE / "claim.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        owner = _read(root.parent / "owner.json")
        yield None if owner and procs.alive(owner) else root


def own(root: Path, record: dict) -> None:
    """Record `record` (a procs record of the containerd now using `root`) as the store's owner."""
    (root.parent / "owner.json").write_text(json.dumps({"pid": record["pid"], "start": record["start"]}))


def imported(root: Path, image: str) -> str | None:
    """The Docker image ID last imported under the name `image`, if that import completed."""
    return (_read(root.parent / "imported.json") or {}).get(image)


def set_imported(root: Path, image: str, docker_id: str | None) -> None:
    """Record (or, with None, forget) that `image` was imported at `docker_id`."""
    path = root.parent / "imported.json"
    table = _read(path) or {}
    if docker_id is None:
        table.pop(image, None)
    else:
        table[image] = docker_id
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(table, indent=1))
    tmp.replace(path)


def containerd_name(image: str) -> str:
    """The name `ctr images import` gives a `docker save`d image: Docker's short names
    expanded (``kvmesh/kvmesh:0.1.0`` -> ``docker.io/kvmesh/kvmesh:0.1.0``)."""
    first, _, rest = image.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        return image
    return f"docker.io/{image}" if rest else f"docker.io/library/{image}"


def _read(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None
