"""Where each message of a chat prompt ends (engine/model/message_ends.py). Pure function; the
tokenizer is a small fake whose template is plain Python, so every case is written out. The real
template on the real hybrid engine is in tests/engine/test_hybrid_checkpoints.py."""

from __future__ import annotations

from kvmesh.engine.model.message_ends import MAX_MESSAGE_ENDS, message_ends
from kvmesh.engine.model.tokenizer import ChatTemplateError


class Template:
    """Each message renders as [role id, its words' lengths..., 9]; without the generation prompt a
    render ends with ``closing`` (a template that closes a conversation differently); a message
    whose content is "!" cannot be rendered alone as the last one."""

    def __init__(self, closing: tuple[int, ...] = ()) -> None:
        self.closing = closing

    def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):
        if not add_generation_prompt and messages[-1]["content"] == "!":
            raise ChatTemplateError("a conversation cannot end here")
        ids = [t for m in messages for t in [1 if m["role"] == "system" else 2,
                                               *(len(w) for w in m["content"].split()), 9]]
        return ids + ([7] if add_generation_prompt else list(self.closing))


def _chat(*contents: str) -> list[dict]:
    return [{"role": "system" if i == 0 else "user", "content": c} for i, c in enumerate(contents)]


def test_each_earlier_message_ends_where_its_render_ends():
    tok = Template()
    chat = _chat("be brief", "hi there", "and now")
    ids = tok.apply_chat_template(chat)
    assert message_ends(tok, chat, ids) == (4, 8)
    assert message_ends(tok, chat[:1], tok.apply_chat_template(chat[:1])) == ()


def test_a_render_that_closes_differently_counts_only_what_the_prompt_shares():
    tok = Template(closing=(8, 8))
    chat = _chat("be brief", "hi")
    assert message_ends(tok, chat, tok.apply_chat_template(chat)) == (4,)


def test_a_prefix_the_template_refuses_gives_no_position_and_the_rest_stay():
    tok = Template()
    chat = _chat("be brief", "!", "ok then")
    assert message_ends(tok, chat, tok.apply_chat_template(chat)) == (4,)


def test_a_long_conversation_keeps_the_first_message_and_the_latest_ones():
    tok = Template()
    chat = _chat(*(f"turn {i}" for i in range(20)))
    ends = message_ends(tok, chat, tok.apply_chat_template(chat))
    assert len(ends) == MAX_MESSAGE_ENDS and ends[0] == 4 and ends[-1] == 19 * 4
    assert list(ends) == sorted(set(ends))
