"""Fixtures for the native CPU kernels' tests: the same test against each build of the library."""

from __future__ import annotations

import platform

import pytest

from kvmesh.engine.kernels import cpu_native as nat


@pytest.fixture(scope="session")
def portable_library(tmp_path_factory):
    lib = nat.build_library("x86-64-v2", cache_dir=tmp_path_factory.mktemp("portable-kernels"))
    assert lib.kvmesh_has_avx512_bf16() == 0  # really the scalar code
    return lib


@pytest.fixture(params=["native", "portable"])
def kernel_build(request, monkeypatch):
    """Point the wrappers at one build of the kernels (the one for this CPU, or the portable
    x86-64-v2 one other CPUs run) for the duration of a test."""
    if request.param == "portable":
        if platform.machine() not in ("x86_64", "AMD64"):
            pytest.skip("the portable build targets x86-64")
        monkeypatch.setattr(nat, "_lib", request.getfixturevalue("portable_library"))
        monkeypatch.setattr(nat, "_tried", True)
    return request.param
