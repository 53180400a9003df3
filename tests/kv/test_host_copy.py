"""HostCopier on the CPU: rows of several tensors land in their slots, others stay as they were.
(The CUDA side-stream path runs only where a GPU is; the host tiers' tests cover its callers.)"""

from __future__ import annotations

import torch

from kvmesh.engine.kv.host_copy import HostCopier


def test_rows_of_each_tensor_land_in_their_slots():
    a, b = torch.zeros(5, 2, 3), torch.zeros(5, 4)
    ra, rb = torch.arange(12.0).view(2, 2, 3), torch.arange(8.0).view(2, 4)
    copier = HostCopier(torch.device("cpu"))
    copier.save([a, b], [ra, rb], torch.tensor([3, 0]))
    copier.wait()
    assert torch.equal(a[3], ra[0]) and torch.equal(a[0], ra[1]) and torch.equal(b[3], rb[0]) and torch.equal(b[0], rb[1])
    assert not a[[1, 2, 4]].any() and not b[[1, 2, 4]].any()
