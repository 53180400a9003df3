"""Recurrent-state checkpoints between the device checkpoint pool and the wire (cache node).

A checkpoint travels as one entry of kind ``state`` (``transfer.header.state_layout``): the
conv state of every DeltaNet layer (``conv.<layer>``, model dtype, ``[conv_dim, K-1]``), then
the recurrent state of every DeltaNet layer (``ssm.<layer>``, fp32, ``[Hv, Dk, Dv]``), back to
back. That is exactly ``StatePool.ckpt_conv[:, e]`` followed by ``ckpt_ssm[:, e]`` flattened, so
one gather per tensor fills a batch's payloads and a received payload is two views.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvmesh.engine.block_hash import BlockHash
from kvmesh.engine.transfer.header import BlockLayout, StateBufferSpec, state_layout


@dataclass(frozen=True)
class StateGeometry:
    """One checkpoint's tensors: ``conv [L, C, K-1]`` in ``conv_dtype``, ``ssm [L, Hv, Dk, Dv]`` fp32."""

    conv_shape: tuple[int, ...]
    conv_dtype: torch.dtype
    ssm_shape: tuple[int, ...]

    @property
    def conv_bytes(self) -> int:
        return int(np.prod(self.conv_shape)) * torch.empty((), dtype=self.conv_dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.conv_bytes + int(np.prod(self.ssm_shape)) * 4

    @classmethod
    def of(cls, ckpt_conv: torch.Tensor, ckpt_ssm: torch.Tensor) -> StateGeometry:
        """From ``StatePool``'s checkpoint tensors (``[L, N, ...]``)."""
        return cls((ckpt_conv.shape[0], *ckpt_conv.shape[2:]), ckpt_conv.dtype, (ckpt_ssm.shape[0], *ckpt_ssm.shape[2:]))


@dataclass
class FetchedState:
    """A checkpoint fetched for an admission: the one at chain position ``blocks`` (its hash
    ends block ``blocks - 1``), as views of the received bytes."""

    blocks: int
    block_hash: BlockHash
    conv: torch.Tensor
    ssm: torch.Tensor


def checkpoint_layout(kv: BlockLayout, layer_ids: Sequence[int], geometry: StateGeometry) -> BlockLayout:
    """The wire layout of this model's checkpoints, beside its KV block layout ``kv``."""
    conv_dtype = str(geometry.conv_dtype).removeprefix("torch.")
    layers = list(layer_ids)
    if len(layers) != geometry.conv_shape[0]:
        raise ValueError(f"{len(layers)} DeltaNet layer ids for {geometry.conv_shape[0]} state layers")
    specs = ([StateBufferSpec(f"conv.{i}", conv_dtype, tuple(geometry.conv_shape[1:])) for i in layers]
             + [StateBufferSpec(f"ssm.{i}", "float32", tuple(geometry.ssm_shape[1:])) for i in layers])
    return state_layout(kv, specs)


def gather_entries(ckpt_conv: torch.Tensor, ckpt_ssm: torch.Tensor, entries: Sequence[int]) -> np.ndarray:
    """``[n, nbytes]`` uint8 host array: each row one entry's wire payload (conv bytes, then ssm)."""
    ids = torch.tensor(list(entries), dtype=torch.int64, device=ckpt_conv.device)
    n = len(ids)
    conv = ckpt_conv.index_select(1, ids).movedim(1, 0).reshape(n, -1).cpu()
    ssm = ckpt_ssm.index_select(1, ids).movedim(1, 0).reshape(n, -1).cpu()
    cb = conv.shape[1] * conv.element_size()
    out = np.empty((n, cb + ssm.shape[1] * 4), np.uint8)
    out[:, :cb] = conv.contiguous().view(torch.uint8).numpy()
    out[:, cb:] = ssm.contiguous().view(torch.uint8).numpy()
    return out


def split_payload(data: np.ndarray, geometry: StateGeometry) -> tuple[torch.Tensor, torch.Tensor]:
    """(conv, ssm) views of one received payload (``geometry.nbytes`` uint8)."""
    if data.nbytes != geometry.nbytes:
        raise ValueError(f"a checkpoint payload of {data.nbytes} bytes, expected {geometry.nbytes}")
    raw = torch.from_numpy(data.reshape(-1))
    cb = geometry.conv_bytes
    conv = raw[:cb].view(geometry.conv_dtype).view(geometry.conv_shape)
    tail = raw[cb:] if cb % 4 == 0 else raw[cb:].clone()  # a float32 view needs 4-byte alignment
    ssm = tail.view(torch.float32).view(geometry.ssm_shape)
    return conv, ssm
