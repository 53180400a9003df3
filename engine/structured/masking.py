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


class _Ahead:
    """Masks filled ahead, right after a step's tokens advanced the matchers: ``mask[j]`` is the
    mask of ``states[j]`` after exactly ``consumed[j]`` tokens. Only the worker thread reads it,
    after it is complete (the worker runs jobs in order)."""

    def __init__(self, states: list[GrammarState], words: int) -> None:
        self.states = states
        self.consumed = [s.consumed for s in states]
        self.mask = torch.empty((len(states), words), dtype=torch.int32)
        self.index = {id(s): j for j, s in enumerate(states)}

    def row(self, state: GrammarState) -> torch.Tensor | None:
        j = self.index.get(id(state))
        if j is None or self.states[j] is not state or self.consumed[j] != state.consumed:
            return None
        return self.mask[j]


class GrammarMasks:
    """One step's masks: ``start`` before the forward pass, ``apply`` after it, ``advance`` after
    sampling. Fills run on one worker thread (llguidance drops the GIL), in submission order.

    ``advance`` submits the next step's fill for the rows that go on (``_Ahead``), so it runs
    beside the engine's single-threaded Python between steps rather than competing with the
    forward pass for the cores; ``start`` then fills only what that missed (new rows, rows that
    were preempted and caught up). Invariant: a matcher is touched by one thread at a time: the
    worker between a fill's submission and its result, the step thread (``advance``) only after
    ``apply`` waited for the step's fill, which runs after any earlier fill ahead.
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab = vocab_size
        self.words = (vocab_size + 31) // 32
        self._pool: ThreadPoolExecutor | None = None
        self._executor: Any = None
        self._bits: torch.Tensor | None = None
        self._ahead: Future | None = None

    @staticmethod
    def needed(reqs: Sequence[Any]) -> bool:
        return any(r.grammar is not None for r in reqs)

    def _submit(self, fn: Any, *args: Any) -> Future:
        if self._pool is None:
            import llguidance

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")
            self._executor = llguidance.LLExecutor(num_threads=1)
        return self._pool.submit(fn, *args)

    def start(self, reqs: Sequence[Any]) -> Future:
        """The step's masks: a future of (mask [k, words] int32, rows), mask row j for batch row
        rows[j], one per constrained request (a matcher in error allows everything: the request
        fails when its token is checked)."""
        rows = [(i, r.grammar, r.output_token_ids) for i, r in enumerate(reqs) if r.grammar is not None]
        return self._submit(self._fill, rows, self._ahead)

    def _fill(self, rows: list[tuple[int, GrammarState, list[int]]], ahead: Future | None
              ) -> tuple[torch.Tensor, list[int]]:
        import llguidance.torch

        done: _Ahead | None = None
        if ahead is not None:
            try:
                done = ahead.result()  # already complete: jobs run in order
            except Exception:  # noqa: BLE001 - a failed fill ahead only means filling here
                done = None
        mask = torch.empty((len(rows), self.words), dtype=torch.int32)
        todo = []
        for j, (_, state, output) in enumerate(rows):
            state.catch_up(output)
            hit = done.row(state) if done is not None and state.error is None else None
            if hit is not None:
                mask[j] = hit
            elif state.error is not None:
                mask[j] = -1
            else:
                todo.append((state.matcher, j))
        if todo:
            llguidance.torch.fill_next_token_bitmask_par(self._executor, todo, mask)
        return mask, [i for i, _, _ in rows]

    def _fill_ahead(self, states: list[GrammarState]) -> _Ahead:
        import llguidance.torch

        ahead = _Ahead(states, self.words)
        llguidance.torch.fill_next_token_bitmask_par(self._executor, [(s.matcher, j) for j, s in enumerate(states)],
                                                     ahead.mask)
        return ahead

    def apply(self, logits: torch.Tensor, pending: Future, raw: torch.Tensor | None, others: bool) -> None:
        """Mask ``logits`` in place (any float dtype: -inf where the grammar refuses, the rest
        untouched). With ``others`` (logit controls ran first, on fp32 ``logits``), a row they left
        with no token the grammar allows (min_tokens holding back the EOS a finished grammar needs,
        say) takes the grammar alone over the ``raw`` logits: the grammar's validity wins."""
        mask, rows = pending.result()
        self._mask_rows(logits, mask, rows)
        if others:
            dead = torch.isinf(logits[torch.tensor(rows, dtype=torch.int64, device=logits.device)]).all(dim=-1)
            if bool(dead.any()):
                js = dead.nonzero().flatten().tolist()
                at = torch.tensor([rows[j] for j in js], dtype=torch.int64, device=logits.device)
                fresh = raw[at].float()
                self._mask_rows(fresh, mask[js], list(range(len(js))))
                logits[at] = fresh

    def _mask_rows(self, logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> None:
        """``logits[rows[j]]`` masked by ``mask[j]``: natively on CPU, else by a byte lookup."""
        from kvmesh.engine.kernels.cpu_native import apply_bitmask_cpu

        if apply_bitmask_cpu(logits, mask, rows):
            return
        if self._bits is None or self._bits.device != logits.device:
            self._bits = _byte_bits().to(logits.device)
        packed = mask.to(logits.device).contiguous().view(torch.uint8)
        refused = ~self._bits[packed.long()].view(len(rows), -1)[:, : logits.shape[1]]
        if rows == list(range(logits.shape[0])):  # every row constrained: in place, no gather
            logits.masked_fill_(refused, float("-inf"))
        else:
            idx = torch.tensor(rows, dtype=torch.int64, device=logits.device)
            logits[idx] = logits[idx].masked_fill_(refused, float("-inf"))

    def advance(self, reqs: Sequence[Any], tokens: Sequence[int]) -> None:
        """Each constrained request's matcher takes its sampled token; then the next step's masks
        are filled ahead for the requests that will need one (not stopped, not in error, below
        max_tokens, not handed to a decode engine)."""
        going: list[GrammarState] = []
        for r, t in zip(reqs, tokens):
            state = r.grammar
            if state is None:
                continue
            state.advance(t)
            if (state.error is None and not state.stopped and r.handoff is None
                    and len(r.output_token_ids) + 1 < r.params.max_tokens):
                going.append(state)
        self._ahead = self._submit(self._fill_ahead, going) if going else None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
