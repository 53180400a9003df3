"""Door checks for the handoff messages a decode engine receives (pure: no engine state).

Every field of a ``Reserve`` or ``PushKV`` that later reaches the step thread is checked here,
against the decode engine's own limits, before anything is reserved or written: a message that
passes cannot make a step raise (a token id outside the vocabulary would fail the embedding of
the next forward pass; a malformed RNG state would fail ``Generator.set_state`` at the claim).
A failure raises ``BadField`` naming the field, which the endpoint answers as ``bad_request``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvmesh.engine.block_hash import HASH_LEN
from kvmesh.engine.sampling import SamplingParams

from ..transfer.errors import HeaderMismatch
from ..transfer.header import KIND_STATE, BlockLayout, check_layout, validate_layout
from ..transfer.protocol import FirstToken, PushKV, Reserve
from .errors import BadField

MAX_TRANSFER_ID_CHARS = 256


@dataclass(frozen=True)
class Limits:
    """What one decode engine accepts: ids in ``[0, vocab_size)``, at most ``max_model_len``
    tokens of prompt plus output, pushes of at most ``max_blocks`` blocks, RNG states of
    ``generator_state_bytes`` bytes (its sampling generator's) and at most ``max_top_logprobs``
    alternatives on the first token."""

    vocab_size: int
    max_model_len: int
    max_blocks: int
    device: str = "cpu"
    max_top_logprobs: int = SamplingParams.MAX_LOGPROBS
    state_bytes: int = 0
    """A hybrid model's recurrent state per request (its final push carries it); 0: none."""

    @property
    def generator_state_bytes(self) -> int:
        return torch.Generator(device=self.device).get_state().numel()


def check_transfer_id(transfer_id: str) -> None:
    if not transfer_id or len(transfer_id) > MAX_TRANSFER_ID_CHARS:
        raise BadField("transfer_id", f"must be 1 to {MAX_TRANSFER_ID_CHARS} characters, got {len(transfer_id)}")


def _check_token(field: str, token_id: int, lim: Limits) -> None:
    if not 0 <= token_id < lim.vocab_size:
        raise BadField(field, f"token id {token_id} is outside this model's vocabulary [0, {lim.vocab_size})")


def check_reserve(msg: Reserve, lim: Limits) -> None:
    check_transfer_id(msg.transfer_id)
    if msg.chain_root and len(msg.chain_root) != HASH_LEN:
        raise BadField("chain_root", f"must be empty or {HASH_LEN} bytes, got {len(msg.chain_root)}")
    ids = msg.prompt_token_ids
    if not ids:
        raise BadField("prompt_token_ids", "must not be empty")
    if len(ids) >= lim.max_model_len:
        raise BadField("prompt_token_ids", f"{len(ids)} tokens leave no room for output in this engine's "
                                           f"context of {lim.max_model_len}")
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= lim.vocab_size:
        bad = lo if lo < 0 else hi
        raise BadField("prompt_token_ids", f"token id {bad} is outside this model's vocabulary "
                                           f"[0, {lim.vocab_size})")
    if not 1 <= msg.max_tokens <= lim.max_model_len - len(ids):
        raise BadField("max_tokens", f"must be in [1, {lim.max_model_len - len(ids)}] for a {len(ids)}-token "
                                     f"prompt (context {lim.max_model_len}), got {msg.max_tokens}")


def _check_logprob(field: str, lp: float) -> None:
    if math.isnan(lp) or lp > 0:  # -inf is a log-probability (of 0)
        raise BadField(field, f"must be a log-probability (<= 0), got {lp}")


def check_first_token(first: FirstToken, lim: Limits) -> None:
    _check_token("first.token_id", first.token_id, lim)
    if first.logprob is not None:
        _check_logprob("first.logprob", first.logprob)
    if len(first.top_logprobs) > lim.max_top_logprobs:
        raise BadField("first.top_logprobs", f"at most {lim.max_top_logprobs} entries, got {len(first.top_logprobs)}")
    for tok, lp in first.top_logprobs:
        _check_token("first.top_logprobs", tok, lim)
        _check_logprob("first.top_logprobs", lp)
    if first.generator_state is not None:
        want = lim.generator_state_bytes
        if len(first.generator_state) != want:
            raise BadField("first.generator_state", f"must be {want} bytes (this engine's sampling generator "
                                                    f"state), got {len(first.generator_state)}")
        try:  # what the claim does with it, on a scratch generator
            torch.Generator(device=lim.device).set_state(
                torch.frombuffer(bytearray(first.generator_state), dtype=torch.uint8))
        except RuntimeError as e:
            raise BadField("first.generator_state", f"not a generator state: {e}") from None
    if first.cached_tokens < 0 or first.cached_tokens >= lim.max_model_len:
        raise BadField("first.cached_tokens", f"must be in [0, {lim.max_model_len}), got {first.cached_tokens}")


def check_push(msg: PushKV, lim: Limits) -> None:
    check_transfer_id(msg.transfer_id)
    if msg.start < 0:
        raise BadField("start", f"must be >= 0, got {msg.start}")
    if len(msg.hashes) > lim.max_blocks:
        raise BadField("hashes", f"at most {lim.max_blocks} blocks in one push, got {len(msg.hashes)}")
    for h in msg.hashes:
        if h is not None and len(h) != HASH_LEN:
            raise BadField("hashes", f"a block hash is {HASH_LEN} bytes, got {len(h)}")
    if msg.state and not msg.final:
        raise BadField("state", "only the final push carries the recurrent state")
    if msg.final and msg.state != bool(lim.state_bytes):
        raise BadField("state", "a hybrid model's final push carries the recurrent state" if lim.state_bytes
                       else "this engine's model keeps no recurrent state; a push cannot carry one")
    if msg.first is not None:
        if not msg.final:
            raise BadField("first", "only the final push carries the first token")
        check_first_token(msg.first, lim)
    elif msg.final:
        raise BadField("first", "the final push must carry the first token")


def check_state_layout(expected: BlockLayout | None, got: BlockLayout | None) -> None:
    """A reservation's recurrent-state layout against the decode engine's own (None: a model without
    one). Raises ``HeaderMismatch`` on the first differing field: the kind, then each buffer's name,
    dtype and shape in order (so a different DeltaNet layer count or state shape is named), then the
    byte sizes; nothing is reserved and no byte is read for a transfer that fails it."""
    if expected is None and got is None:
        return
    if expected is None or got is None:
        raise HeaderMismatch("state", "a recurrent-state layout" if expected is not None else "none",
                             "none" if got is None else f"{len(got.buffers)} state buffers",
                             "one engine runs a hybrid model and the other does not")
    if got.kind != KIND_STATE:
        raise HeaderMismatch("state.kind", KIND_STATE, got.kind)
    validate_layout(got)
    check_layout(expected, got)
