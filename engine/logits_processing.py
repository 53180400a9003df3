"""Logit controls before sampling: penalties, logit bias, min_tokens, allowed tokens, bad words.

Each control is one batched tensor op over the rows of the step's logits that use it; nothing
loops over the vocabulary in Python. Token counts for the penalties live in one table on the
logits' device, a row per live request that has a penalty, updated in place with the token each
step samples, so a step never rebuilds them from the token lists.

Semantics follow OpenAI and vLLM: presence and frequency penalties count the generated tokens
only, ``logit - frequency * count - presence * (count > 0)``; the repetition penalty covers
prompt and generated tokens, dividing a positive logit by it and multiplying a negative one.
A bad word's token sequence bans its last token when the generated tokens end with the rest of
it (vLLM's ``bad_words``); finding those tokens loops over a request's few sequences, never
over the vocabulary, and every masked token of the step is written by one index op.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvmesh.engine.request import Request


def banned_tokens(words: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """The last token of each sequence in `words` whose other tokens end `output` (a one-token
    sequence always matches)."""
    n = len(output)
    out = []
    for w in words:
        k = len(w) - 1
        if k <= n and all(output[n - k + j] == w[j] for j in range(k)):
            out.append(w[-1])
    return out


def _penalized(req: Request) -> bool:
    p = req.params
    return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)


@dataclass
class PenaltyTable:
    """Per-request token statistics, a row each, for the requests that have a penalty.

    Invariant: for a request holding row r, ``counts[r, t]`` is how often t occurs in its
    output_token_ids and ``seen[r, t]`` whether t occurs in its prompt or output, as of the last
    ``record``. Rows are taken on a request's first penalized step (seeded from its tokens so far,
    which covers a request that arrived by transfer) and given back by ``release``.
    """

    vocab_size: int
    device: torch.device
    counts: torch.Tensor = field(init=False)
    seen: torch.Tensor = field(init=False)
    rows: dict[str, int] = field(default_factory=dict)
    free: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.counts = torch.zeros((0, self.vocab_size), dtype=torch.float32, device=self.device)
        self.seen = torch.zeros((0, self.vocab_size), dtype=torch.bool, device=self.device)

    def _grow(self) -> None:
        old = self.counts.shape[0]
        new = max(8, 2 * old)
        counts = torch.zeros((new, self.vocab_size), dtype=torch.float32, device=self.device)
        seen = torch.zeros((new, self.vocab_size), dtype=torch.bool, device=self.device)
        counts[:old] = self.counts
        seen[:old] = self.seen
        self.counts, self.seen = counts, seen
        self.free.extend(range(new - 1, old - 1, -1))

    def row(self, req: Request) -> int:
        r = self.rows.get(req.request_id)
        if r is not None:
            return r
        if not self.free:
            self._grow()
        r = self.free.pop()
        out = torch.tensor(req.output_token_ids, dtype=torch.int64, device=self.device)
        self.counts[r].zero_()
        self.counts[r].index_add_(0, out, torch.ones(out.shape[0], device=self.device))
        self.seen[r].zero_()
        self.seen[r, torch.tensor(req.prompt_token_ids, dtype=torch.int64, device=self.device)] = True
        self.seen[r, out] = True
        self.rows[req.request_id] = r
        return r

    def record(self, reqs: Sequence[Request], tokens: Sequence[int]) -> None:
        """Count the token each of `reqs` just sampled (those without a row are skipped)."""
        pairs = [(self.rows[q.request_id], t) for q, t in zip(reqs, tokens) if q.request_id in self.rows]
        if not pairs:
            return
        idx = torch.tensor(pairs, dtype=torch.int64, device=self.device)
        self.counts.index_put_((idx[:, 0], idx[:, 1]), torch.ones(len(pairs), device=self.device), accumulate=True)
        self.seen[idx[:, 0], idx[:, 1]] = True

    def release(self, request_id: str) -> None:
        r = self.rows.pop(request_id, None)
        if r is not None:
            self.free.append(r)


class LogitsProcessor:
    """Applies every request's logit controls to a step's logits (see the module docstring)."""

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int], device: torch.device) -> None:
        self.eos = tuple(eos_token_ids)
        self.table = PenaltyTable(vocab_size, device)

    @staticmethod
    def needed(reqs: Sequence[Request]) -> bool:
        return any(r.params.controls_logits for r in reqs)

    def apply(self, logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
        """logits: fp32 [len(reqs), vocab], modified in place and returned."""
        device = logits.device
        neg_inf = float("-inf")
        allowed = [(i, r.params.allowed_token_ids) for i, r in enumerate(reqs) if r.params.allowed_token_ids]
        if allowed:
            keep = torch.zeros((len(allowed), logits.shape[1]), dtype=torch.bool, device=device)
            ri = [j for j, (_, ids) in enumerate(allowed) for _ in ids]
            ti = [t for _, ids in allowed for t in ids]
            keep[torch.tensor(ri, device=device), torch.tensor(ti, device=device)] = True
            rows = torch.tensor([i for i, _ in allowed], device=device)
            logits[rows] = logits[rows].masked_fill(~keep, neg_inf)
        bias = [(i, t, b) for i, r in enumerate(reqs) for t, b in r.params.logit_bias.items()]
        if bias:
            rows_t, toks, vals = zip(*bias)
            logits.index_put_((torch.tensor(rows_t, device=device), torch.tensor(toks, device=device)),
                              torch.tensor(vals, dtype=logits.dtype, device=device), accumulate=True)
        masked = [(i, t) for i, r in enumerate(reqs) if len(r.output_token_ids) < r.params.min_tokens
                  for t in (*self.eos, *r.params.stop_token_ids)]
        masked += [(i, t) for i, r in enumerate(reqs) if r.params.bad_words_token_ids
                   for t in banned_tokens(r.params.bad_words_token_ids, r.output_token_ids)]
        if masked:
            idx = torch.tensor(masked, dtype=torch.int64, device=device)
            logits[idx[:, 0], idx[:, 1]] = neg_inf
        pen = [i for i, r in enumerate(reqs) if _penalized(r)]
        if pen:
            self._penalize(logits, [reqs[i] for i in pen], pen)
        return logits

    def _penalize(self, logits: torch.Tensor, reqs: list[Request], at: list[int]) -> None:
        device = logits.device
        table = self.table
        slab = torch.tensor([table.row(r) for r in reqs], dtype=torch.int64, device=device)
        rows = torch.tensor(at, dtype=torch.int64, device=device)
        sub = logits[rows]
        rep = [r.params.repetition_penalty for r in reqs]
        if any(x != 1.0 for x in rep):
            rp = torch.tensor(rep, dtype=sub.dtype, device=device).unsqueeze(1)
            sub = torch.where(table.seen[slab], torch.where(sub > 0, sub / rp, sub * rp), sub)
        freq = torch.tensor([r.params.frequency_penalty for r in reqs], dtype=sub.dtype, device=device).unsqueeze(1)
        pres = torch.tensor([r.params.presence_penalty for r in reqs], dtype=sub.dtype, device=device).unsqueeze(1)
        counts = table.counts[slab]
        sub = sub - freq * counts - pres * (counts > 0).to(sub.dtype)
        logits[rows] = sub

    def record(self, reqs: Sequence[Request], tokens: Sequence[int]) -> None:
        if self.table.rows:
            self.table.record(reqs, tokens)

    def release(self, request_id: str) -> None:
        self.table.release(request_id)
