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
