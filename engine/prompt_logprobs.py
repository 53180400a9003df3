"""Prompt logprobs: the logprob of each prompt token given the tokens before it.

The rows of a prefill chunk whose next token is a prompt token not yet scored are kept beside
the sampling rows in the forward pass; their logits are computed in slices, so a long chunk never
holds a [chunk, vocab] tensor at once. Only requests that ask for them pay anything: a step
without one takes the runner's usual paths unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmesh.engine.outputs import TokenLogprob

SLICE_ROWS = 256


@dataclass
class PromptRows:
    """Rows of the step's flat batch to score: ``rows[i]`` predicts prompt token ``targets[i]``
    of ``owners[i]`` (a Request), whose list it extends in order."""

    rows: list[int]
    targets: list[int]
    owners: list[object]

    def record(self, model, hidden: torch.Tensor) -> None:
        """hidden [len(rows), hidden] -> a TokenLogprob appended to each owner's prompt_logprobs."""
        targets = torch.tensor(self.targets, dtype=torch.int64, device=hidden.device)
        for start in range(0, len(self.rows), SLICE_ROWS):
            end = min(start + SLICE_ROWS, len(self.rows))
            logp = torch.log_softmax(model.compute_logits(hidden[start:end]).float(), dim=-1)
            chosen = logp.gather(1, targets[start:end].unsqueeze(1)).squeeze(1).tolist()
            owners = self.owners[start:end]
            k = max(o.params.prompt_logprobs for o in owners)  # type: ignore[attr-defined]
            top_v, top_i = logp.topk(k, dim=-1) if k else (None, None)
            for j, owner in enumerate(owners):
                want = owner.params.prompt_logprobs  # type: ignore[attr-defined]
                top = list(zip(top_i[j, :want].tolist(), top_v[j, :want].tolist())) if want else []
                owner.prompt_logprobs.append(TokenLogprob(self.targets[start + j], chosen[j], top))  # type: ignore


def prompt_logprob_rows(out, query_start_loc: torch.Tensor) -> PromptRows | None:
    """The step's rows to score, or None when no scheduled request collects prompt logprobs."""
    seqs = [(i, s) for i, s in enumerate(out.seqs) if s.request.collects_prompt_logprobs]
    if not seqs:
        return None
    starts = query_start_loc.tolist()
    rows, targets, owners = [], [], []
    for i, s in seqs:
        req = s.request
        done = len(req.prompt_logprobs)  # positions 1..done are scored: next is position done + 1
        first = max(s.num_computed_tokens, done)  # a recomputed chunk scores only what is new
        upto = min(s.num_computed_tokens + s.num_new_tokens, req.num_prompt_tokens - 1)
        for pos in range(first, upto):
            rows.append(starts[i] + pos - s.num_computed_tokens)
            targets.append(req.prompt_token_ids[pos + 1])
            owners.append(req)
    return PromptRows(rows, targets, owners) if rows else None
