"""The decode engine's door checks on handoff messages (pure functions; real protocol structs).

Each refused message names its field; a message the prefill side really sends passes.
"""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine.disagg.checks import Limits, check_push, check_reserve, check_transfer_id
from kvmesh.engine.disagg.errors import BadField
from kvmesh.engine.transfer.header import kv_layout
from kvmesh.engine.transfer.protocol import FirstToken, PushKV, Reserve

LIM = Limits(vocab_size=1000, max_model_len=256, max_blocks=64)
LAYOUT = kv_layout(b"x", "float32", 16, 2, 2, 8)
H = b"\x01" * 32


def _refused(fn, msg, field: str) -> None:
    with pytest.raises(BadField) as e:
        fn(msg, LIM)
    assert e.value.field == field and field in str(e.value)


def test_a_good_reserve_and_push_pass():
    check_reserve(Reserve("t", LAYOUT, [1, 2, 999], 253), LIM)
    state = bytes(torch.Generator().manual_seed(3).get_state().numpy())
    first = FirstToken(7, -0.5, [(7, -0.5), (8, -2.0)], state, 16)
    check_push(PushKV("t", 0, [H, None], True, first), LIM)
    check_push(PushKV("t", 2, [H] * 64), LIM)


@pytest.mark.parametrize("prompt,max_tokens,field", [
    ([], 4, "prompt_token_ids"),
    ([1, -1], 4, "prompt_token_ids"),
    ([1, 1000], 4, "prompt_token_ids"),
    (list(range(256)), 1, "prompt_token_ids"),
    ([1, 2], 0, "max_tokens"),
    ([1, 2], 255, "max_tokens"),
])
def test_a_reserve_outside_the_engines_limits_names_the_field(prompt, max_tokens, field):
    _refused(check_reserve, Reserve("t", LAYOUT, prompt, max_tokens), field)


@pytest.mark.parametrize("push,field", [
    (PushKV("", 0, [H]), "transfer_id"),
    (PushKV("t" * 257, 0, [H]), "transfer_id"),
    (PushKV("t", -1, [H]), "start"),
    (PushKV("t", 0, [H] * 65), "hashes"),
    (PushKV("t", 0, [b"\x01" * 31]), "hashes"),
    (PushKV("t", 0, [H], False, FirstToken(1)), "first"),
    (PushKV("t", 0, [H], True, None), "first"),
    (PushKV("t", 0, [H], True, FirstToken(-1)), "first.token_id"),
    (PushKV("t", 0, [H], True, FirstToken(1000)), "first.token_id"),
    (PushKV("t", 0, [H], True, FirstToken(1, float("nan"))), "first.logprob"),
    (PushKV("t", 0, [H], True, FirstToken(1, 0.5)), "first.logprob"),
    (PushKV("t", 0, [H], True, FirstToken(1, -1.0, [(1, -1.0)] * 21)), "first.top_logprobs"),
    (PushKV("t", 0, [H], True, FirstToken(1, -1.0, [(-3, -1.0)])), "first.top_logprobs"),
    (PushKV("t", 0, [H], True, FirstToken(1, None, [], b"\0" * 16)), "first.generator_state"),
    (PushKV("t", 0, [H], True, FirstToken(1, None, [], b"\xff" * 5056)), "first.generator_state"),
    (PushKV("t", 0, [H], True, FirstToken(1, None, [], None, -1)), "first.cached_tokens"),
])
def test_a_push_outside_the_engines_limits_names_the_field(push, field):
    _refused(check_push, push, field)


def test_transfer_ids_are_bounded():
    check_transfer_id("a" * 256)
    with pytest.raises(BadField):
        check_transfer_id("a" * 257)
