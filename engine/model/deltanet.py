"""The gated DeltaNet token mixer of a hybrid layer over a flat batch with slot-held state.

The flat batch is laid out as for attention (decodes first): the decode rows run the conv
and the delta rule one step each, batched over sequences; the prefill sequences run the conv
per sequence and the chunked delta rule together (right-padded, which leaves states intact,
see ``gated_delta.chunked``). Each sequence starts from its slot's state, or from zeros when
it starts at token 0, and leaves its final state in the slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvmesh.engine.kernels.gated_delta import GatedDeltaKernels, l2norm
from kvmesh.engine.model.config import LinearAttnSpec
from kvmesh.engine.model.linear import LinearFn
from kvmesh.engine.model.recurrent_state import StateBatch


@dataclass
class DeltaNetWeights:
    in_qkv: LinearFn  # -> [T, conv_dim] (q | k | v before the conv)
    in_z: LinearFn  # -> [T, value_dim] (the output gate)
    in_ba: LinearFn  # -> [T, 2 * Hv] (beta logits | decay input), fused b|a
    conv: torch.Tensor  # [conv_dim, K]
    neg_a: torch.Tensor  # fp32 [Hv]: -exp(A_log)
    dt_bias: torch.Tensor  # fp32 [Hv]
    norm: torch.Tensor  # [Dv], the gated RMSNorm's weight (not zero-centred)
    out: LinearFn


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * norm(x) * silu(gate)`` rounded where transformers' Qwen3_5RMSNormGated rounds."""
    dtype = x.dtype
    xf = x.float()
    y = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (y * F.silu(gate.float())).to(dtype)


def deltanet_mix(x: torch.Tensor, w: DeltaNetWeights, spec: LinearAttnSpec, layer: int, batch: StateBatch,
                 kernels: GatedDeltaKernels, eps: float) -> torch.Tensor:
    """x [T, hidden] (normed) -> the mixer's output [T, hidden]; updates slot state of DeltaNet ``layer``."""
    t = x.shape[0]
    hk, hv, dk, dv = spec.num_k_heads, spec.num_v_heads, spec.k_head_dim, spec.v_head_dim
    pool, nd = batch.pool, batch.num_decodes
    conv_state, ssm_state = pool.conv[layer], pool.ssm[layer]
    mixed = w.in_qkv(x)
    z = w.in_z(x)
    ba = w.in_ba(x)
    beta = ba[:, :hv].sigmoid().float()
    g = w.neg_a * F.softplus(ba[:, hv:].float() + w.dt_bias)  # log decay, <= 0

    # -- short causal conv ------------------------------------------------------------------
    kw = w.conv.shape[1]
    conv_out = torch.empty_like(mixed)
    if nd:
        slots = batch.slots_t[:nd]
        prev = conv_state[slots] * batch.initial_mask[:nd, None, None]
        conv_out[:nd], conv_state[slots] = kernels.conv_step(mixed[:nd], w.conv, prev)
    start = nd
    for i in range(nd, len(batch.slots)):  # per prefill sequence, never per token
        n, slot = batch.query_lens[i], batch.slots[i]
        prev = conv_state[slot] if batch.has_initial[i] else torch.zeros_like(conv_state[slot])
        inner = [(c, e) for c, e in batch.captures[i] if c < n]
        for c, e in inner:  # conv state after c of this step's inputs: the K-1 inputs before token c
            lo = c - (kw - 1)  # only that window is copied, never the chunk's whole input
            window = mixed[start + max(lo, 0):start + c].t()
            pool.ckpt_conv[layer, e] = window if lo >= 0 else torch.cat([prev[:, lo:], window], dim=1)
        conv_out[start:start + n], conv_state[slot] = kernels.conv_prefill(mixed[start:start + n], w.conv, prev)
        start += n

    q, k, v = conv_out.split([spec.key_dim, spec.key_dim, spec.value_dim], dim=-1)
    q = l2norm(q.float().view(t, hk, dk)) * dk ** -0.5
    k = l2norm(k.float().view(t, hk, dk))
    v = v.float().view(t, hv, dv)
    if hv != hk:  # grouped: q/k head j serves value heads [j * r, (j + 1) * r)
        q, k = q.repeat_interleave(hv // hk, dim=1), k.repeat_interleave(hv // hk, dim=1)

    # -- gated delta rule ------------------------------------------------------------------
    core = torch.empty(t, hv, dv, dtype=torch.float32, device=x.device)
    if nd:
        slots = batch.slots_t[:nd]
        prev = ssm_state[slots] * batch.initial_mask[:nd, None, None, None]
        core[:nd], ssm_state[slots] = kernels.recurrent_step(q[:nd], k[:nd], v[:nd], g[:nd], beta[:nd], prev)
    if nd < len(batch.slots):
        _prefill_delta(q, k, v, g, beta, core, batch, layer, kernels)
    # Captures at the end of a sequence's chunk: its final state, now in its slot.
    for i, caps in enumerate(batch.captures):
        if caps and caps[-1][0] == batch.query_lens[i]:
            e, slot = caps[-1][1], batch.slots[i]
            pool.ckpt_conv[layer, e] = conv_state[slot]
            pool.ckpt_ssm[layer, e] = ssm_state[slot]
    core = gated_rms_norm(core.to(x.dtype).reshape(t * hv, dv), w.norm, z.reshape(t * hv, dv), eps)
    return w.out(core.reshape(t, hv * dv))


def _prefill_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   core: torch.Tensor, batch: StateBatch, layer: int, kernels: GatedDeltaKernels) -> None:
    """The chunked delta rule over the prefill sequences (rows after the decodes), writing ``core``,
    the slots' final states, and the states at captures inside a sequence's chunk."""
    nd, pool = batch.num_decodes, batch.pool
    ssm_state = pool.ssm[layer]
    lens = batch.query_lens[nd:]
    slots = batch.slots_t[nd:]
    init = ssm_state[slots] * batch.initial_mask[nd:, None, None, None]

    def pad(a: torch.Tensor) -> torch.Tensor:  # [P, H, T_max, ...]; zero padding leaves states intact
        return torch.nn.utils.rnn.pad_sequence(list(a[nd:].split(lens)), batch_first=True).transpose(1, 2)

    inner = [(j, c, e) for j, n in enumerate(lens) for c, e in batch.captures[nd + j] if c < n]
    out, final, captured = kernels.chunked(pad(q), pad(k), pad(v), pad(g), pad(beta), init,
                                           capture=[(j, c) for j, c, _ in inner] or None)
    ssm_state[slots] = final
    for i, (_, _, e) in enumerate(inner):
        pool.ckpt_ssm[layer, e] = captured[i]
    out = out.transpose(1, 2)  # [P, T_max, H, Dv]
    mask = torch.arange(max(lens), device=q.device)[None, :] < torch.tensor(lens, device=q.device)[:, None]
    core[nd:] = out[mask]
