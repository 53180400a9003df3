"""Response bodies and stream chunks of the OpenAI APIs: pure functions over engine outputs.

Bodies are plain dicts serialized once with `json.dumps`; on the streaming
path that is the only per-token work besides queueing, which keeps the event
loop ahead of the engine at full batch.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from kvmesh.engine.outputs import TokenLogprob

TokenText = Callable[[int], str]

SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> bytes:
    """One server-sent event carrying `obj` as compact JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


# ---- logprobs -----------------------------------------------------------------------------


def chat_logprobs(entries: Sequence[TokenLogprob], token_text: TokenText) -> dict[str, Any]:
    """Chat format: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    content = []
    for e in entries:
        tok = token_text(e.token_id)
        content.append({
            "token": tok,
            "logprob": _finite(e.logprob),
            "bytes": list(tok.encode("utf-8")),
            "top_logprobs": [
                {"token": (t := token_text(tid)), "logprob": _finite(lp), "bytes": list(t.encode("utf-8"))}
                for tid, lp in e.top
            ],
        })
    return {"content": content}


def completion_logprobs(entries: Sequence[TokenLogprob], token_text: TokenText, text_offset: int,
                        num_top: int) -> tuple[dict[str, Any], int]:
    """Legacy completions format; returns it and the text offset after the last token.

    `top_logprobs` holds the `num_top` best alternatives plus the sampled token
    (OpenAI returns up to logprobs + 1 entries).
    """
    tokens, token_lps, tops, offsets = [], [], [], []
    for e in entries:
        tok = token_text(e.token_id)
        tokens.append(tok)
        token_lps.append(_finite(e.logprob))
        offsets.append(text_offset)
        text_offset += len(tok)
        top: dict[str, float] = {}
        for tid, lp in e.top[:num_top]:
            top.setdefault(token_text(tid), _finite(lp))
        top.setdefault(tok, _finite(e.logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, text_offset


def completion_prompt_logprobs(prompt_ids: Sequence[int], entries: Sequence[TokenLogprob], token_text: TokenText,
                               num_top: int) -> dict[str, Any]:
    """The echoed prompt's part of the legacy logprobs: its first token has none (null), as OpenAI
    reports it; offsets count from the start of the prompt."""
    first = token_text(prompt_ids[0])
    body, _ = completion_logprobs(entries, token_text, len(first), num_top)
    return {"tokens": [first, *body["tokens"]], "token_logprobs": [None, *body["token_logprobs"]],
            "top_logprobs": [None, *body["top_logprobs"]], "text_offset": [0, *body["text_offset"]]}


def prompt_logprobs_list(entries: Sequence[TokenLogprob], token_text: TokenText) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: None for the first token, then per token a map from token id to
    {logprob, decoded_token} (and ``rank`` for the top alternatives), the prompt's own token first."""
    out: list[dict[str, Any] | None] = [None]
    for e in entries:
        d = {str(e.token_id): {"logprob": _finite(e.logprob), "decoded_token": token_text(e.token_id)}}
        for rank, (tid, lp) in enumerate(e.top, 1):
            entry = d.setdefault(str(tid), {"logprob": _finite(lp), "decoded_token": token_text(tid)})
            entry["rank"] = rank
        out.append(d)
    return out


def _finite(x: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number. -9999 is what other servers send.
    return x if x > -9999.0 else -9999.0


# ---- bodies -------------------------------------------------------------------------------


def completion_body(rid: str, created: int, model: str, choices: list[dict[str, Any]],
                    usage_: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage_}


def completion_choice(index: int, text: str, finish_reason: str | None,
                      logprobs: dict[str, Any] | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_chunk(rid: str, created: int, model: str, choice: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def chat_body(rid: str, created: int, model: str, choices: list[dict[str, Any]],
              usage_: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage_}


def chat_choice(index: int, text: str | None, finish_reason: str | None,
                logprobs: dict[str, Any] | None, tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_chunk(rid: str, created: int, model: str, index: int, delta: dict[str, Any],
               finish_reason: str | None = None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}


def usage_chunk(rid: str, created: int, model: str, obj: str, usage_: dict[str, Any]) -> dict[str, Any]:
    """The final stream chunk of `stream_options.include_usage`: no choices, just usage."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage_}
