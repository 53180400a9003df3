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
    """Rows of the step's flat batch to score, one contiguous run per request: ``segments[i]`` is
    (request, first row, number of rows), row j of it predicting prompt token ``targets`` of the
    same place, in order; each request's prompt_logprobs list is extended by its run."""

    rows: torch.Tensor
    targets: list[int]
    segments: list[tuple[object, int]]

    def record(self, model, hidden: torch.Tensor) -> None:
        """hidden [len(rows), hidden] -> the TokenLogprobs appended to each request's list."""
        targets = torch.tensor(self.targets, dtype=torch.int64, device=hidden.device)
        k = max(req.params.prompt_logprobs for req, _ in self.segments)  # type: ignore[attr-defined]
        chosen: list[float] = []
        top_i: list[list[int]] = []
        top_v: list[list[float]] = []
        for start in range(0, len(self.targets), SLICE_ROWS):
            logp = torch.log_softmax(model.compute_logits(hidden[start:start + SLICE_ROWS]).float(), dim=-1)
            chosen += logp.gather(1, targets[start:start + SLICE_ROWS].unsqueeze(1)).squeeze(1).tolist()
            if k:
                v, i = logp.topk(k, dim=-1)
                top_v += v.tolist()
                top_i += i.tolist()
        at = 0
        for req, n in self.segments:
            want = req.params.prompt_logprobs  # type: ignore[attr-defined]
            req.prompt_logprobs.extend(  # type: ignore[attr-defined]
                TokenLogprob(self.targets[j], chosen[j], list(zip(top_i[j][:want], top_v[j][:want])) if want else [])
                for j in range(at, at + n))
            at += n


def prompt_logprob_rows(out, query_start_loc: torch.Tensor) -> PromptRows | None:
    """The step's rows to score, or None when no scheduled request collects prompt logprobs."""
    seqs = [(i, s) for i, s in enumerate(out.seqs) if s.request.collects_prompt_logprobs]
    if not seqs:
        return None
    starts = query_start_loc.tolist()
    runs, targets, segments = [], [], []
    for i, s in seqs:
        req, c = s.request, s.num_computed_tokens
        # Position p predicts prompt token p + 1; positions before len(prompt_logprobs) are scored
        # already (a recomputed chunk after preemption scores only what is new).
        first = max(c, len(req.prompt_logprobs))
        upto = min(c + s.num_new_tokens, req.num_prompt_tokens - 1)
        if upto <= first:
            continue
        runs.append(torch.arange(starts[i] + first - c, starts[i] + upto - c, dtype=torch.int64))
        targets += req.prompt_token_ids[first + 1:upto + 1]
        segments.append((req, upto - first))
    return PromptRows(torch.cat(runs), targets, segments) if runs else None
