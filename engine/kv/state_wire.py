"""A hybrid request's recurrent state between its slot and the wire: one gather out, one scatter in.

The state of one request (``StatePool`` slot) is, per gated DeltaNet layer, the conv state
``[conv_dim, K-1]`` in the model dtype and the recurrent state ``[Hv, Dk, Dv]`` in fp32. On the
wire it is one payload whose named buffers are ``ssm.<layer>`` for every DeltaNet layer, then
``conv.<layer>`` for every one (``<layer>``: the model's layer index). That order makes a slot's
bytes two contiguous runs (the pool is ``ssm [L, S, ...]`` and ``conv [L, S, ...]``), so a
gather or scatter is two copies whatever the layer count: no per-layer loop on the data path;
the fp32 run goes first so the model-dtype run starts 4-byte aligned (a typed view needs it).

Invariant: ``state_nbytes(layout) == StatePool.bytes_per_slot`` of the model the layout was made
from, and ``gather_state`` / ``scatter_state`` read and write exactly that many bytes in layout
order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvmesh.engine.model.recurrent_state import StatePool
from kvmesh.engine.transfer.header import KIND_STATE, BlockLayout, StateBufferSpec, state_layout


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def state_specs(pool: StatePool, linear_layers: Sequence[int]) -> list[StateBufferSpec]:
    """The named buffers of one slot, in wire order (all recurrent states, then all conv states)."""
    if len(linear_layers) != pool.conv.shape[0]:
        raise ValueError(f"{len(linear_layers)} DeltaNet layer indices for a pool of {pool.conv.shape[0]} layers")
    conv, ssm = tuple(pool.conv.shape[2:]), tuple(pool.ssm.shape[2:])
    return ([StateBufferSpec(f"ssm.{i}", _dtype_name(pool.ssm.dtype), ssm) for i in linear_layers]
            + [StateBufferSpec(f"conv.{i}", _dtype_name(pool.conv.dtype), conv) for i in linear_layers])


def handoff_state_layout(kv: BlockLayout, pool: StatePool, linear_layers: Sequence[int]) -> BlockLayout:
    """The state layout a hybrid engine sends (prefill) or accepts (decode) beside its KV layout ``kv``."""
    return state_layout(kv, state_specs(pool, linear_layers))


def state_nbytes(layout: BlockLayout) -> int:
    if layout.kind != KIND_STATE:
        raise ValueError(f"not a state layout (kind {layout.kind!r})")
    return layout.nbytes


def _split(pool: StatePool) -> tuple[int, int]:
    """Bytes of one slot's recurrent states and of its conv states."""
    return pool.ssm.element_size() * pool.ssm[:, 0].numel(), pool.conv.element_size() * pool.conv[:, 0].numel()


def slot_nbytes(pool: StatePool) -> int:
    """Bytes of one slot on the wire (``StatePool.bytes_per_slot`` of the pool's model)."""
    return sum(_split(pool))


def _views(pool: StatePool, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(conv, ssm) typed views of a flat uint8 slot payload, shaped like ``pool.conv[:, s]`` / ``pool.ssm[:, s]``."""
    conv_shape, ssm_shape = (pool.conv.shape[0], *pool.conv.shape[2:]), (pool.ssm.shape[0], *pool.ssm.shape[2:])
    n_ssm, n_conv = _split(pool)
    if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() != n_conv + n_ssm:
        raise ValueError(f"a slot's state is {n_conv + n_ssm} flat bytes; got a {tuple(flat.shape)} {flat.dtype} tensor")
    return flat[n_ssm:].view(pool.conv.dtype).view(conv_shape), flat[:n_ssm].view(pool.ssm.dtype).view(ssm_shape)


def gather_state(pool: StatePool, slot: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """A flat uint8 host copy of ``slot`` in wire order (into ``out`` when given): two copies."""
    flat = torch.empty(slot_nbytes(pool), dtype=torch.uint8) if out is None else out
    conv, ssm = _views(pool, flat)
    conv.copy_(pool.conv[:, slot])
    ssm.copy_(pool.ssm[:, slot])
    return flat


def scatter_state(pool: StatePool, slot: int, flat: torch.Tensor) -> None:
    """Write a payload (as ``gather_state`` makes it) into ``slot``: two copies. Synchronous (the
    caller drops ``flat`` right after), also on a GPU."""
    conv, ssm = _views(pool, flat)
    pool.conv[:, slot].copy_(conv)
    pool.ssm[:, slot].copy_(ssm)
