"""Root test configuration.

Triton decides at kernel-decoration time whether to compile or interpret, so without a
CUDA device the interpreter must be switched on before any kernel module is imported.
Setting it here, before collection, makes the ``*_triton`` kernels runnable on CPU in
every test module regardless of import order.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Fuzz tests (hypothesis) run the same examples on every run, so a CI result depends on the code
# alone; KVMESH_HYPOTHESIS=explore draws new ones on every run, to hunt for bugs.
from hypothesis import settings as _hypothesis_settings  # noqa: E402

_hypothesis_settings.register_profile("repeatable", derandomize=True, print_blob=True)
_hypothesis_settings.register_profile("explore", derandomize=False)
_hypothesis_settings.load_profile("explore" if os.environ.get("KVMESH_HYPOTHESIS") == "explore" else "repeatable")


import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _free_engines_after_each_module():
    """An engine is freed when its last reference goes, but one held from a reference cycle (an
    app's closures, a failed test's traceback) waits for the cycle collector, and an in-process
    server's KV pools are mapped whole at start-up (2 GiB by default on CPU). Collecting after
    each module keeps one process running every suite down to the current module's engines."""
    yield
    gc.collect()
