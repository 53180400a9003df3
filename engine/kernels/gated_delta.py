"""Gated DeltaNet math (Qwen3.5 / Qwen3-Next linear attention): the short causal conv and the
gated delta rule, as torch references over batches of sequences.

The recurrence, per value head, with state ``S [Dk, Dv]``, decay ``g <= 0`` (log space) and
write strength ``beta in (0, 1)``::

    S_t = exp(g_t) * S_{t-1}
    S_t = S_t + k_t (beta_t (v_t - k_t^T S_t))^T        (the delta rule: write only the error)
    o_t = S_t^T q_t

``recurrent_step`` runs it for one token of many sequences (decode). ``chunked`` runs whole
prompts: within a chunk of C tokens the C sequential writes collapse into triangular solves
and matmuls (the WY / UT form), and only the chunks are walked in order, so there is no
per-token Python loop; it can also return the state after any given token (checkpoints). Both start from a given state and return the final one, which is what
lets a prompt be prefilled in pieces, resumed after a step, or restored from a checkpoint.

Inputs are expected already L2-normalised (q, k), q already scaled by ``Dk ** -0.5``, and
grouped heads already expanded, all in fp32: the caller owns those steps so the state stays
in fp32 whatever the model dtype. ``GatedDeltaKernels`` is the seam the engine calls through:
"torch" (these functions, the reference and the CPU path) or "triton" (``gated_delta_triton``:
the chunked scan and the recurrent step as Triton kernels, the conv from here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (the FLA library's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv_prefill(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU over one sequence's new inputs.

    x [T, C]; weight [C, K]; state [C, K-1], the inputs before x (zeros at a sequence's start).
    Returns (y [T, C], new state [C, K-1]: the last K-1 inputs, older state included when T < K-1).
    """
    kw = weight.shape[1]
    full = torch.cat([state.to(x.dtype), x.t()], dim=1)  # [C, K-1+T]
    # Sliding windows [C, T, K] times the taps: a grouped F.conv1d costs ~200x more on CPU at
    # these sizes (oneDNN setup per call) for the same sums.
    y = (full.unfold(1, kw, 1) * weight.unsqueeze(1)).sum(-1)  # [C, T]
    return F.silu(y).t(), full[:, full.shape[1] - (kw - 1):]


def causal_conv_step(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One new input per sequence: x [B, C], states [B, C, K-1] -> (y [B, C], new states [B, C, K-1])."""
    window = torch.cat([states.to(x.dtype), x.unsqueeze(-1)], dim=-1)  # [B, C, K]
    y = (window * weight.unsqueeze(0)).sum(-1)
    return F.silu(y), window[..., 1:]


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence. q, k [B, H, Dk]; v [B, H, Dv]; g, beta [B, H]; state [B, H, Dk, Dv].

    Returns (out [B, H, Dv], new state); ``state`` is not modified.
    """
    s = state * g.exp()[..., None, None]
    kv_mem = (s * k.unsqueeze(-1)).sum(dim=-2)
    delta = (v - kv_mem) * beta.unsqueeze(-1)
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (s * q.unsqueeze(-1)).sum(dim=-2), s


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor, chunk: int = CHUNK,
            capture: list[tuple[int, int]] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Whole sequences at once. q, k [B, H, T, Dk]; v [B, H, T, Dv]; g, beta [B, H, T];
    state [B, H, Dk, Dv]. Returns (out [B, H, T, Dv], final state [B, H, Dk, Dv], captured).

    ``capture``: (sequence b, tokens t) pairs, 1 <= t <= T: ``captured[i]`` [H, Dk, Dv] is
    sequence b's state after its first t tokens (None when nothing is asked). A state inside a
    chunk follows from the state at the chunk's start and that chunk's corrected values, so
    capturing costs one small matmul each and never splits the scan.

    Sequences of different lengths may share a call right-padded with zeros: a padded
    position has k = v = 0 and beta = g = 0, so it leaves the state unchanged (decay 1, no
    write) and the final state is that after each sequence's last real token.
    """
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    # A short piece (a chunked-prefill slice) needs no 64-wide solve: the math is the same for
    # any chunk size, only the cost differs.
    chunk = min(chunk, max(16, 1 << (t - 1).bit_length()))
    pad = (-t) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (t + pad) // chunk
    q, k, v = (x.reshape(b, h, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(b, h, n, chunk), beta.reshape(b, h, n, chunk)
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    cum = g.cumsum(dim=-1)  # log of the decay from the chunk's start through each position
    pos = torch.arange(chunk, device=q.device)
    upper = pos[None, :] > pos[:, None]
    # decay[i, j] = exp(cum_i - cum_j) for j <= i: what survives from position j to i.
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    # (I + strictly-lower part of A) is the UT system; its diagonal is taken as 1.
    a = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(a, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(a, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_dec = q * cum.exp().unsqueeze(-1)
    k_dec = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = torch.empty(b, h, n, chunk, dv, dtype=v.dtype, device=v.device)
    by_chunk: dict[int, list[tuple[int, int, int]]] = {}
    for i, (seq, tok) in enumerate(capture or ()):
        if not 1 <= tok <= t:
            raise ValueError(f"capture after {tok} tokens is outside 1..{t}")
        by_chunk.setdefault((tok - 1) // chunk, []).append((i, seq, tok - (tok - 1) // chunk * chunk))
    captured = torch.empty(len(capture or ()), h, dk, dv, dtype=v.dtype, device=v.device) if capture else None
    s = state.to(v.dtype)
    for i in range(n):  # chunks only: each depends on the state the previous one left
        v_new = u[:, :, i] - w[:, :, i] @ s
        out[:, :, i] = q_dec[:, :, i] @ s + attn[:, :, i] @ v_new
        if i in by_chunk:
            _capture(by_chunk[i], s, cum[:, :, i], k[:, :, i], v_new, pos, captured)
        s = s * chunk_decay[:, :, i] + k_dec[:, :, i].transpose(-1, -2) @ v_new
    return out.reshape(b, h, n * chunk, dv)[:, :, :t], s, captured


def _capture(points: list[tuple[int, int, int]], s: torch.Tensor, cum: torch.Tensor, k: torch.Tensor,
             v_new: torch.Tensor, pos: torch.Tensor, captured: torch.Tensor) -> None:
    """States after m tokens of one chunk, for (output row, sequence, m) ``points``, all at once:
    ``S_m = exp(cum_{m-1}) S_0 + sum_{j < m} exp(cum_{m-1} - cum_j) k_j v_new_j^T``.
    s [B, H, Dk, Dv] at the chunk's start; cum [B, H, C]; k [B, H, C, Dk]; v_new [B, H, C, Dv]."""
    rows = _index_or_slice([p[0] for p in points], s.device)
    seqs = _index_or_slice([p[1] for p in points], s.device)
    m = torch.tensor([p[2] for p in points], device=s.device)
    c = cum[seqs]  # [N, H, C]
    c_end = c.gather(-1, (m - 1).view(-1, 1, 1).expand(-1, c.shape[1], 1))  # [N, H, 1]
    keep = (c_end - c).masked_fill((pos[None, :] >= m[:, None])[:, None, :], float("-inf")).exp()
    captured[rows] = s[seqs] * c_end.exp().unsqueeze(-1) + (k[seqs] * keep.unsqueeze(-1)).transpose(-1, -2) @ v_new[seqs]


def _index_or_slice(ids: list[int], device: torch.device) -> slice | torch.Tensor:
    """A run of consecutive ids as a slice (a view: no gather copy, the common case of one capture
    per sequence), anything else as an index tensor."""
    if ids == list(range(ids[0], ids[0] + len(ids))):
        return slice(ids[0], ids[0] + len(ids))
    return torch.tensor(ids, device=device)


@dataclass(frozen=True)
class GatedDeltaKernels:
    """The DeltaNet layer's kernels, chosen once per engine with the attention backend. Every
    set has the torch functions' signatures and contracts (captures included)."""

    name: str
    chunked: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]
    recurrent_step: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    conv_prefill: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    conv_step: Callable[..., tuple[torch.Tensor, torch.Tensor]]


def gated_delta_kernels(name: str = "torch") -> GatedDeltaKernels:
    """The kernel set called ``name``: "torch" (any device) or "triton" (CUDA, or CPU under
    ``TRITON_INTERPRET=1``; the short conv stays on torch, it is a few elementwise ops)."""
    if name == "torch":
        return GatedDeltaKernels("torch", chunked, recurrent_step, causal_conv_prefill, causal_conv_step)
    if name == "triton":
        from .gated_delta_triton import chunked_triton, recurrent_step_triton

        return GatedDeltaKernels("triton", chunked_triton, recurrent_step_triton, causal_conv_prefill,
                                 causal_conv_step)
    raise ValueError(f"no gated DeltaNet kernels called {name!r}; kvmesh has 'torch' and 'triton'")
