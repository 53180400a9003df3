"""The gated MLP activation: ``silu(gate) * up`` over one fused gate|up projection.

``silu_mul_ref(gate_up)`` takes ``[T, 2 * I]`` (gate in the first half of each row, up in
the second) and returns ``[T, I]`` computed exactly as HF's ``act_fn(gate) * up``: SiLU
rounded to the activation dtype, then the product rounded again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up must have an even last dimension, got {tuple(gate_up.shape)}")
    g, u = gate_up.chunk(2, dim=-1)
    return F.silu(g) * u
