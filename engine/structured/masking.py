"""Grammar masks in the engine step: computed while the forward pass runs, applied as one op.

Each constrained request holds a ``GrammarState``: its matcher and how many of its output
tokens the matcher has consumed. Before a mask is computed the matcher catches up on output
tokens it has not seen (the first token a prefill engine sampled, for a request that arrived by
transfer), so the state always follows ``output_token_ids`` whatever path the request took;
preemption keeps the output tokens, so it needs no rollback.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch


class GrammarViolation(RuntimeError):
    """A sampled token the matcher refused: a bug, reported to that request only."""


@dataclass
class GrammarState:
    """Invariant: ``matcher`` has consumed exactly ``output_token_ids[:consumed]``."""

    matcher: Any
    consumed: int = 0
    stopped: bool = False
    """The grammar is complete and allows nothing more: the request ends with "stop"."""
    error: str | None = None

    def catch_up(self, output: Sequence[int]) -> None:
        if self.consumed < len(output) and self.error is None:
            if not self.matcher.consume_tokens(list(output[self.consumed:])):
                self.error = self.matcher.get_error() or "the output does not match the grammar"
            self.consumed = len(output)
            self.stopped = self.matcher.is_stopped()

    def advance(self, token: int) -> None:
        if self.error is not None:
            return
        if not self.matcher.consume_token(token):
            self.error = self.matcher.get_error() or f"token {token} does not match the grammar"
        self.consumed += 1
        self.stopped = self.matcher.is_stopped()


def _byte_bits() -> torch.Tensor:
    """[256, 8] bool: bit b of byte value v, so a little-endian bitmask viewed as bytes unpacks
    by one gather (token 8 * i + b is byte i's bit b)."""
    v = torch.arange(256, dtype=torch.int32).unsqueeze(1)
    return ((v >> torch.arange(8, dtype=torch.int32)) & 1).bool()


class GrammarMasks:
    """One step's masks: ``start`` before the forward pass, ``apply`` after it, ``advance`` after
    sampling. The fill runs on a worker thread (llguidance drops the GIL), overlapping the model."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab = vocab_size
        self.words = (vocab_size + 31) // 32
        self._pool: ThreadPoolExecutor | None = None
        self._executor: Any = None
        self._bits: torch.Tensor | None = None

    @staticmethod
    def needed(reqs: Sequence[Any]) -> bool:
        return any(r.grammar is not None for r in reqs)

    def start(self, reqs: Sequence[Any]) -> Future:
        """Masks [len(reqs), words] (int32 bits; rows of unconstrained requests allow everything)."""
        if self._pool is None:
            import llguidance

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")
            self._executor = llguidance.LLExecutor(num_threads=1)
        return self._pool.submit(self._fill, [(i, r.grammar, r.output_token_ids) for i, r in enumerate(reqs)
                                              if r.grammar is not None], len(reqs))

    def _fill(self, rows: list[tuple[int, GrammarState, list[int]]], n: int) -> tuple[torch.Tensor, list[int]]:
        import llguidance.torch

        mask = torch.full((n, self.words), -1, dtype=torch.int32)
        for _, state, output in rows:
            state.catch_up(output)
        live = [(state.matcher, i) for i, state, _ in rows if state.error is None]
        if live:
            llguidance.torch.fill_next_token_bitmask_par(self._executor, live, mask)
        return mask, [i for i, _, _ in rows]

    def apply(self, logits: torch.Tensor, pending: Future, raw: torch.Tensor, others: bool) -> None:
        """Mask ``logits`` (fp32, in place). With ``others`` (logit controls ran first), a row they
        left with no token the grammar allows (min_tokens holding back the EOS a finished grammar
        needs, say) takes the grammar alone over the raw logits: the grammar's validity wins."""
        mask, rows = pending.result()
        if self._bits is None or self._bits.device != logits.device:
            self._bits = _byte_bits().to(logits.device)
        words = mask[rows] if len(rows) < mask.shape[0] else mask
        packed = words.to(logits.device).contiguous().view(torch.uint8)
        allowed = self._bits[packed.long()].view(len(rows), -1)[:, : logits.shape[1]]
        if len(rows) == logits.shape[0]:  # every row constrained: in place, no gather
            sub = logits.masked_fill_(~allowed, float("-inf"))
        else:
            idx = torch.tensor(rows, dtype=torch.int64, device=logits.device)
            sub = logits[idx].masked_fill_(~allowed, float("-inf"))
        if others:
            dead = torch.isinf(sub).all(dim=-1)
            if bool(dead.any()):
                at = torch.tensor(rows, dtype=torch.int64, device=logits.device)[dead]
                sub[dead] = raw[at].float().masked_fill(~allowed[dead], float("-inf"))
        if len(rows) < logits.shape[0]:
            logits[idx] = sub

    @staticmethod
    def advance(reqs: Sequence[Any], tokens: Sequence[int]) -> None:
        for r, t in zip(reqs, tokens):
            if r.grammar is not None:
                r.grammar.advance(t)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
