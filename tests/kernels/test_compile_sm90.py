"""The Triton kernels compile for sm_90 (H100/H200) even on a machine without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.engine.util.cache_dir import default_cache_dir

SCRIPT = Path(__file__).with_name("_compile_sm90.py")


@pytest.mark.slow  # compiles every Triton kernel for sm90 without a GPU: 120-170 s when uncached
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # A cache of its own in the machine's cache directory (never the user's ~/.triton, which a
    # GPU run fills with other targets' kernels). Triton keys each entry by the kernel's source
    # and everything it calls, the target, the options and Triton's version, so a changed
    # kernel compiles again and an unchanged one reads the result its compile gave before.
    env["TRITON_CACHE_DIR"] = str(default_cache_dir() / "triton-sm90")
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    result = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=900
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("\n") == 20, result.stdout
