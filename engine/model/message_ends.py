"""Where each message of a chat prompt ends, in tokens: the points a later conversation that
shares the earlier messages leaves this one (a hybrid model checkpoints its state there)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvmesh.engine.model.tokenizer import ChatTemplateError

MAX_MESSAGE_ENDS = 8
"""Message ends computed per prompt, at most (the first message's and the latest ones'): each
costs one more template render and, on a hybrid model, a checkpoint entry."""


def message_ends(tokenizer: Any, messages: Sequence[Any], ids: Sequence[int], **template_kwargs: Any) -> tuple[int, ...]:
    """For each message before the last, the length of the longest common prefix of ``ids`` (the
    prompt ``tokenizer.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs)``
    gave) and the render of the messages up to it. A position is thus always a true prefix of the
    prompt, whatever the template does at a turn's end; a prefix the template cannot render alone
    (it raises ``ChatTemplateError``) gives none. Increasing positions, no zeros."""
    ks = list(range(1, len(messages)))
    if len(ks) > MAX_MESSAGE_ENDS:
        ks = ks[:1] + ks[-(MAX_MESSAGE_ENDS - 1):]
    ends: list[int] = []
    for k in ks:
        try:
            pre = tokenizer.apply_chat_template(list(messages[:k]), add_generation_prompt=False, **template_kwargs)
        except ChatTemplateError:
            continue
        n = min(len(pre), len(ids))
        # Usually the render is a prefix of the prompt: one list comparison, no loop per token.
        m = n if list(ids[:n]) == list(pre[:n]) else next(i for i in range(n) if pre[i] != ids[i])
        if m and (not ends or m > ends[-1]):
            ends.append(m)
    return tuple(ends)
