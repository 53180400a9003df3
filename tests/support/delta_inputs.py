"""Random inputs of the gated delta rule, shaped as the kernels take them (tests/kernels)."""

from __future__ import annotations

import torch

from kvmesh.engine.kernels import gated_delta as gd


def delta_inputs(b: int, h: int, t: int, dk: int, dv: int, seed: int = 0, with_state: bool = True):
    """(q, k, v, decay, beta, state): q, k [B, H, T, Dk] L2-normalised (q scaled by Dk^-0.5), v
    [B, H, T, Dv], decay (log space, <= 0) and beta [B, H, T], state [B, H, Dk, Dv] (zeros without)."""
    g = torch.Generator().manual_seed(seed)
    q = gd.l2norm(torch.randn(b, h, t, dk, generator=g)) * dk ** -0.5
    k = gd.l2norm(torch.randn(b, h, t, dk, generator=g))
    v = torch.randn(b, h, t, dv, generator=g)
    decay = -torch.rand(b, h, t, generator=g) * 0.5
    beta = torch.rand(b, h, t, generator=g)
    state = torch.randn(b, h, dk, dv, generator=g) * 0.1 if with_state else torch.zeros(b, h, dk, dv)
    return q, k, v, decay, beta, state
