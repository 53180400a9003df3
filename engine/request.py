"""A request's state as the scheduler and engine see it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from kvmesh.engine.block_hash import ROOT_HASH
from kvmesh.engine.outputs import RequestMetrics
from kvmesh.engine.roles import PrefillHandoff
from kvmesh.engine.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One sequence being generated.

    Invariant: all_token_ids == prompt_token_ids + output_token_ids, and
    num_computed_tokens <= len(all_token_ids) counts the tokens whose K/V sit in
    the request's blocks (after preemption it drops back to 0: recompute).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    priority: int = 0
    arrival_seq: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens served from the prefix cache at first scheduling
    num_preemptions: int = 0
    kv_root: bytes = ROOT_HASH
    """The request's block chain root (``block_hash.chain_root`` of its ``cache_salt``): requests
    share cached KV only when their roots are equal."""
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    generator: torch.Generator | None = None
    handoff: PrefillHandoff | None = None
    """Prefill role: after the first token, hand the KV of the prompt's blocks to a decode engine
    (blocks are held, not freed) instead of generating further (engine/roles.py)."""
    handoff_sent: int = 0
    """Prefill role: prompt blocks before this index were already handed over in parts."""
    transferred: bool = False
    """Decode role: the prompt's KV arrived by transfer; it holds every block it will need and is
    never chosen as a preemption victim."""
    handoff_state: torch.Tensor | None = None
    """Decode role, hybrid models: the recurrent state at the prompt's end that came with the
    transfer (flat host bytes, ``kv.slot_wire``); the engine writes it into the request's slot
    before its first step and drops it."""
    prompt_logprobs: list[Any] | None = None
    """With ``params.prompt_logprobs``: a ``TokenLogprob`` per prompt position after the first,
    appended as prefill computes them (complete once len == num_prompt_tokens - 1)."""
    state_hints: tuple[int, ...] = ()
    """Hybrid models: prompt positions where later prompts are expected to diverge (a chat
    prompt's message ends, branch points the router learned): the recurrent state is
    checkpointed at the block boundary at or before each (engine/kv/hybrid_state.py)."""
    grammar: Any = None
    """A ``structured.masking.GrammarState`` when the output is constrained, else None."""
    # Engine-side streaming state (detokenizer, stop checker, emitted offsets).
    stream: Any = None

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def collects_prompt_logprobs(self) -> bool:
        """Prompt logprobs are wanted and not all computed yet: no prefix-cache hits for it."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def sort_key(self) -> tuple[int, int]:
        """Lower sorts first: served earlier, preempted later."""
        return (self.priority, self.arrival_seq)
