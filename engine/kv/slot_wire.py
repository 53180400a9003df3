"""A hybrid request's recurrent state between its slot and the wire: one gather out, one scatter in.

The state of one request (``StatePool`` slot) is, per gated DeltaNet layer, the conv state
``[conv_dim, K-1]`` in the model dtype and the recurrent state ``[Hv, Dk, Dv]`` in fp32. On the
wire (a prefill -> decode handoff) it is one payload whose named buffers are ``conv.<layer>`` for
every DeltaNet layer, then ``ssm.<layer>`` for every one (``<layer>``: the model's layer index):
the same layout as a checkpoint on the cache node, since a checkpoint is a copy of a slot. That
order makes a slot's bytes two contiguous runs (the pool is ``conv [L, S, ...]`` and
``ssm [L, S, ...]``), so a gather or scatter is two copies whatever the layer count: no
per-layer loop on the data path. (When the conv run is not a multiple of 4 bytes the fp32 run
cannot be viewed in place; it then goes through one more copy.)

Invariant: ``slot_nbytes(pool) == StatePool.bytes_per_slot`` of the pool's model ==
``layout.nbytes`` of its ``slot_state_layout``, and ``gather_state`` / ``scatter_state`` read and
write exactly that many bytes in layout order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvmesh.engine.model.recurrent_state import StatePool
from kvmesh.engine.kv.state_wire import StateGeometry, checkpoint_layout
from kvmesh.engine.transfer.header import BlockLayout


def slot_state_layout(kv: BlockLayout, pool: StatePool, linear_layers: Sequence[int]) -> BlockLayout:
    """The state layout a hybrid engine sends (prefill) or accepts (decode) beside its KV layout
    ``kv``: the checkpoint layout (``state_wire.checkpoint_layout``), since a slot and a checkpoint
    hold the same tensors."""
    return checkpoint_layout(kv, linear_layers, StateGeometry.of(pool.conv, pool.ssm))


def _split(pool: StatePool) -> tuple[int, int]:
    """Bytes of one slot's conv states and of its recurrent states."""
    return pool.conv.element_size() * pool.conv[:, 0].numel(), pool.ssm.element_size() * pool.ssm[:, 0].numel()


def slot_nbytes(pool: StatePool) -> int:
    """Bytes of one slot on the wire (``StatePool.bytes_per_slot`` of the pool's model)."""
    return sum(_split(pool))


def _runs(pool: StatePool, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The conv and ssm byte runs of a flat uint8 slot payload."""
    n_conv, n_ssm = _split(pool)
    if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() != n_conv + n_ssm:
        raise ValueError(f"a slot's state is {n_conv + n_ssm} flat bytes; got a {tuple(flat.shape)} {flat.dtype} tensor")
    return flat[:n_conv], flat[n_conv:]


def _typed(run: torch.Tensor, like: torch.Tensor) -> torch.Tensor | None:
    """``run`` viewed as ``like``'s dtype and shape, or None when its offset does not allow a view."""
    if run.storage_offset() % like.element_size():
        return None
    return run.view(like.dtype).view(like.shape)


def gather_state(pool: StatePool, slot: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """A flat uint8 host copy of ``slot`` in wire order (into ``out`` when given): two copies."""
    flat = torch.empty(slot_nbytes(pool), dtype=torch.uint8) if out is None else out
    for run, src in zip(_runs(pool, flat), (pool.conv[:, slot], pool.ssm[:, slot])):
        view = _typed(run, src)
        if view is not None:
            view.copy_(src)
        else:  # misaligned fp32 run: through a contiguous copy
            run.copy_(src.contiguous().cpu().view(torch.uint8).reshape(-1))
    return flat


def scatter_state(pool: StatePool, slot: int, flat: torch.Tensor) -> None:
    """Write a payload (as ``gather_state`` makes it) into ``slot``: two copies. Synchronous (the
    caller drops ``flat`` right after), also on a GPU."""
    for run, dst in zip(_runs(pool, flat), (pool.conv[:, slot], pool.ssm[:, slot])):
        view = _typed(run, dst)
        dst.copy_(view if view is not None else _typed(run.clone(), dst))
