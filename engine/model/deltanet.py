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
    conv_out = torch.empty_like(mixed)
    if nd:
        slots = batch.slots_t[:nd]
        prev = conv_state[slots] * batch.initial_mask[:nd, None, None]
        conv_out[:nd], conv_state[slots] = kernels.conv_step(mixed[:nd], w.conv, prev)
    start = nd
    for i in range(nd, len(batch.slots)):  # per prefill sequence, never per token
        n, slot = batch.query_lens[i], batch.slots[i]
        prev = conv_state[slot] if batch.has_initial[i] else torch.zeros_like(conv_state[slot])
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
        lens = batch.query_lens[nd:]
        slots = batch.slots_t[nd:]
        init = ssm_state[slots] * batch.initial_mask[nd:, None, None, None]
        longest = max(lens)
        # [P, H, T_max, ...], right-padded with zeros (a no-op for the state).
        def pad(a: torch.Tensor) -> torch.Tensor:
            return torch.nn.utils.rnn.pad_sequence(list(a[nd:].split(lens)), batch_first=True).transpose(1, 2)

        out, final = kernels.chunked(pad(q), pad(k), pad(v), pad(g), pad(beta), init)
        ssm_state[slots] = final
        out = out.transpose(1, 2)  # [P, T_max, H, Dv]
        mask = torch.arange(longest, device=x.device)[None, :] < torch.tensor(lens, device=x.device)[:, None]
        core[nd:] = out[mask]
    core = gated_rms_norm(core.to(x.dtype).reshape(t * hv, dv), w.norm, z.reshape(t * hv, dv), eps)
    return w.out(core.reshape(t, hv * dv))
