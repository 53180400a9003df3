"""Tool definitions and a chat request builder shared by the tool-call tests."""

from __future__ import annotations

from kvmesh.engine.api.protocol import ChatCompletionRequest

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def chat(**kw) -> ChatCompletionRequest:
    """A chat request (one user turn unless ``messages`` is given) with the fields ``kw``."""
    return ChatCompletionRequest(messages=kw.pop("messages", [{"role": "user", "content": "hi"}]), **kw)
