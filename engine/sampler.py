"""Turn a batch of logits into next tokens: greedy, temperature, top-k, top-p,
min-p, per-request seeds and top-n logprobs, all as batched tensor ops.

A seeded request draws its noise from its own generator, so its tokens do not
depend on what else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmesh.engine.kernels.cpu_native import argmax_rows
from kvmesh.engine.outputs import TokenLogprob
from kvmesh.engine.sampling import SamplingParams


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def _apply_filters(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask (to -inf) tokens excluded by top-k, top-p and min-p; logits already temperature-scaled."""
    device = logits.device
    top_k = [p.top_k if p.top_k > 0 else 0 for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    if any(top_k) or any(x < 1.0 for x in top_p):
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        rank = torch.arange(vocab, device=device).expand_as(sorted_logits)
        k = torch.tensor([k if k else vocab for k in top_k], device=device).unsqueeze(1)
        remove = rank >= k
        if any(x < 1.0 for x in top_p):
            probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
            cum = probs.cumsum(dim=-1)
            p = torch.tensor(top_p, device=device, dtype=probs.dtype).unsqueeze(1)
            # Keep the smallest prefix whose mass reaches top_p (the first token always survives).
            remove |= (cum - probs) >= p
        mask = torch.zeros_like(remove).scatter_(-1, sorted_idx, remove)
        logits = logits.masked_fill(mask, float("-inf"))
    if any(x > 0.0 for x in min_p):
        probs = logits.softmax(dim=-1)
        thresh = torch.tensor(min_p, device=device, dtype=probs.dtype).unsqueeze(1) * probs.amax(-1, keepdim=True)
        logits = logits.masked_fill(probs < thresh, float("-inf"))
    return logits


def _scale(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Logits divided by each row's temperature (greedy rows by 1), shifted so each row's max is 0.

    Shifting first keeps any positive temperature finite: (x - max) / t is <= 0, so a tiny t
    sends the other tokens to -inf instead of overflowing the maximum to inf (inf - inf is
    NaN, and a NaN row would sample token 0).
    """
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params],
                         device=logits.device, dtype=logits.dtype).unsqueeze(1)
    return (logits - logits.amax(dim=-1, keepdim=True)) / temps


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator | None = None,
    raw_logits: torch.Tensor | None = None,
) -> SampleResult:
    """logits: [N, vocab] in the model's dtype, one row per request in `params` order.

    Greedy picks need no upcast (bf16 -> fp32 is exact, so the argmax is the same);
    probabilities and logprobs are computed in fp32. Rows without a generator of their own
    draw from `default_generator` (torch's global generator when None). Logprobs come from
    `raw_logits` when given: the model's distribution before logit controls (as vLLM reports
    them), so a masked token never shows as -inf.
    """
    n = logits.shape[0]
    greedy = [p.greedy for p in params]
    if all(greedy):
        tokens = argmax_rows(logits)
    if not all(greedy) or any(p.logprobs is not None for p in params):
        logits = logits.float()
    if not all(greedy):
        filtered = _apply_filters(_scale(logits, params), params)
        probs = filtered.softmax(dim=-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) samples from p.
        noise = torch.empty_like(probs)
        seeded = [i for i, g in enumerate(generators) if g is not None]
        if len(seeded) < n:
            noise.exponential_(generator=default_generator)
        for i in seeded:
            noise[i].exponential_(generator=generators[i])
        tokens = argmax_rows(probs / noise)
        if any(greedy):
            g = torch.tensor(greedy, device=logits.device)
            tokens = torch.where(g, argmax_rows(logits), tokens)
    token_list = tokens.tolist()
    want = [p.logprobs for p in params]
    lps: list[TokenLogprob | None] = [None] * n
    if any(w is not None for w in want):
        rows = [i for i, w in enumerate(want) if w is not None]
        source = logits if raw_logits is None else raw_logits.float()
        logp = torch.log_softmax(source[rows], dim=-1)
        chosen = logp.gather(1, tokens[rows].unsqueeze(1)).squeeze(1).tolist()
        kmax = max(want[i] for i in rows)
        top_vals, top_ids = (logp.topk(kmax, dim=-1) if kmax > 0 else (None, None))
        for j, i in enumerate(rows):
            top: list[tuple[int, float]] = []
            if want[i]:
                top = list(zip(top_ids[j, : want[i]].tolist(), top_vals[j, : want[i]].tolist()))
            lps[i] = TokenLogprob(token_list[i], chosen[j], top)
    return SampleResult(token_list, lps)
