"""Per-request recurrent state of a hybrid model: the tensors of the slot pool, and what one
forward pass needs to read and write them.

A slot holds, for every gated DeltaNet layer, the conv state (the last ``K-1`` conv inputs)
and the recurrent state (``[Hv, Dk, Dv]``, kept in fp32 whatever the model dtype: it
accumulates over the whole sequence, and rounding it each token would drift). Unlike KV it
cannot be rebuilt from the tokens short of replaying them all, so a request owns its slot
from admission to finish or preemption (engine/kv/state_slots.py assigns them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import ModelConfig


class StatePool:
    """``conv [L, S, conv_dim, K-1]`` in the model dtype and ``ssm [L, S, Hv, Dk, Dv]`` in fp32,
    for L DeltaNet layers and S slots. Slots are never zeroed: a sequence that starts fresh
    reads zeros instead of its slot (``StateBatch.has_initial``)."""

    def __init__(self, config: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device,
                 num_checkpoints: int = 0) -> None:
        lin = config.linear
        if lin is None:
            raise ValueError(f"{config.arch} has no recurrent layers; it needs no state pool")
        n = len(config.linear_layers)
        self.num_slots = num_slots
        self.conv = torch.zeros((n, num_slots, lin.conv_dim, lin.conv_kernel - 1), dtype=dtype, device=device)
        self.ssm = torch.zeros((n, num_slots, lin.num_v_heads, lin.k_head_dim, lin.v_head_dim),
                               dtype=torch.float32, device=device)
        # Checkpoint entries (engine/kv/state_checkpoints.py indexes them), same layout as slots.
        # Empty, not zeros: an entry is read only after a step wrote it, and on CPU untouched
        # pages of a large budget cost no memory.
        self.num_checkpoints = num_checkpoints
        self.ckpt_conv = torch.empty((n, num_checkpoints, *self.conv.shape[2:]), dtype=dtype, device=device)
        self.ckpt_ssm = torch.empty((n, num_checkpoints, *self.ssm.shape[2:]), dtype=torch.float32, device=device)

    @staticmethod
    def bytes_per_slot(config: ModelConfig, dtype_bytes: int) -> int:
        """Bytes one request's state occupies across all DeltaNet layers (also one checkpoint's size)."""
        lin = config.linear
        if lin is None:
            return 0
        per_layer = lin.conv_dim * (lin.conv_kernel - 1) * dtype_bytes + lin.num_v_heads * lin.k_head_dim * lin.v_head_dim * 4
        return len(config.linear_layers) * per_layer

    def restore(self, entry: int, slot: int) -> None:
        """Copy checkpoint ``entry`` into ``slot`` (every layer)."""
        self.conv[:, slot].copy_(self.ckpt_conv[:, entry])
        self.ssm[:, slot].copy_(self.ckpt_ssm[:, entry])

    def read(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of one slot's (conv [L, C, K-1], ssm [L, Hv, Dk, Dv])."""
        return self.conv[:, slot].clone(), self.ssm[:, slot].clone()

    def write(self, slot: int, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        self.conv[:, slot].copy_(conv)
        self.ssm[:, slot].copy_(ssm)


@dataclass
class StateBatch:
    """The recurrent side of one forward pass, sequences in the attention metadata's order
    (decodes first).

    Invariants: len(slots) == len(has_initial) == len(query_lens) == number of sequences;
    slots are distinct; has_initial[i] is False exactly when sequence i starts at token 0
    this step (its slot then holds a previous owner's state, which must not be read).
    """

    pool: StatePool
    slots: list[int]
    has_initial: list[bool]
    query_lens: list[int]
    num_decodes: int
    # Per sequence: (k, entry) pairs, k in 1..query_len: after the sequence's first k tokens of
    # this step, write its state into checkpoint ``entry``. Sorted by k; empty lists when none.
    captures: list[list[tuple[int, int]]] | None = None
    slots_t: torch.Tensor | None = None  # int64 [B] on the pool's device
    initial_mask: torch.Tensor | None = None  # bool [B] on the pool's device

    def __post_init__(self) -> None:
        if self.captures is None:
            self.captures = [[] for _ in self.slots]
        if not len(self.slots) == len(self.has_initial) == len(self.query_lens) == len(self.captures):
            raise ValueError("slots, has_initial, query_lens and captures must describe the same sequences")
        dev = self.pool.ssm.device
        self.slots_t = torch.tensor(self.slots, dtype=torch.int64, device=dev)
        self.initial_mask = torch.tensor(self.has_initial, dtype=torch.bool, device=dev)
