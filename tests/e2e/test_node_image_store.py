"""The real node's persistent image store (e2e/localcluster/image_store.py), without a node.

Real: the claim lock, the owner check against live processes (this test's own process and a
child that has exited), the records on disk. Not run here: containerd itself; the real-pod
tests start their node on the store (tests/e2e/conftest.py).
"""

from __future__ import annotations

import os
import subprocess
import sys

from .helpers import ROOT

sys.path.insert(0, str(ROOT / "e2e"))
from localcluster import image_store, procs  # noqa: E402


def _record(pid: int) -> dict:
    return {"pid": pid, "start": procs._start_ticks(pid)}


def test_a_free_store_is_claimed_and_an_owned_one_is_not(tmp_path, monkeypatch):
    monkeypatch.setattr(image_store, "MIN_FREE_BYTES_FOR_NEW_STORE", 0)  # whatever this disk has
    with image_store.claim(tmp_path) as root:
        assert root == tmp_path / image_store.STORE / "root" and root.is_dir()
        image_store.own(root, _record(os.getpid()))  # alive: this process
    with image_store.claim(tmp_path) as again:
        assert again is None, "a store whose containerd is alive is not shared"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    image_store.own(root, {"pid": gone.pid, "start": 1})  # exited: the store is free again
    with image_store.claim(tmp_path) as root2:
        assert root2 == root


def test_no_new_store_on_a_full_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(image_store, "MIN_FREE_BYTES_FOR_NEW_STORE", 1 << 62)
    with image_store.claim(tmp_path) as root:
        assert root is None and not (tmp_path / image_store.STORE).exists()


def test_imported_records_only_completed_imports(tmp_path):
    root = tmp_path / "node-images" / "root"
    root.mkdir(parents=True)
    assert image_store.imported(root, "kvmesh/kvmesh:0.1.0") is None
    image_store.set_imported(root, "kvmesh/kvmesh:0.1.0", "sha256:aa")
    image_store.set_imported(root, "other:1", "sha256:bb")
    assert image_store.imported(root, "kvmesh/kvmesh:0.1.0") == "sha256:aa"
    image_store.set_imported(root, "kvmesh/kvmesh:0.1.0", None)  # an import is starting
    assert image_store.imported(root, "kvmesh/kvmesh:0.1.0") is None
    assert image_store.imported(root, "other:1") == "sha256:bb"
    (root.parent / "imported.json").write_text("{not json")
    assert image_store.imported(root, "other:1") is None  # a torn record means: import again


def test_containerd_names_of_docker_images():
    assert image_store.containerd_name("kvmesh/kvmesh:0.1.0") == "docker.io/kvmesh/kvmesh:0.1.0"
    assert image_store.containerd_name("busybox:1") == "docker.io/library/busybox:1"
    assert image_store.containerd_name("kvmesh.local/pause:1") == "kvmesh.local/pause:1"
    assert image_store.containerd_name("localhost/x:1") == "localhost/x:1"
    assert image_store.containerd_name("host:5000/x:1") == "host:5000/x:1"
