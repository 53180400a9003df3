"""The Triton kernels compile for sm_90 (H100/H200) even on a machine without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("_compile_sm90.py")


@pytest.mark.slow  # compiles every Triton kernel for sm90 without a GPU: about 60 s
def test_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compile for real, not from cache
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    result = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=900
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("\n") == 20, result.stdout
