"""``building``: what a first-use build writes lands on its target whole, or not at all."""

from __future__ import annotations

import pytest

from kvmesh.engine.util.cache_dir import building


def test_a_finished_build_replaces_the_target_in_one_move(tmp_path):
    target = tmp_path / "deep" / "lib.so"
    with building(target) as out:
        assert out.parent != target.parent and out.name == target.name
        out.write_bytes(b"new")
    assert target.read_bytes() == b"new" and list(target.parent.iterdir()) == [target]


def test_a_failed_build_leaves_the_old_target_and_no_scratch(tmp_path):
    target = tmp_path / "lib.so"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError), building(target) as out:
        out.write_bytes(b"half")
        raise RuntimeError("compiler failed")
    assert target.read_bytes() == b"old" and list(tmp_path.iterdir()) == [target]
