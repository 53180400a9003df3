"""Tool calls for chat: the tools rendered into the prompt and `required` and named choices
enforced by a grammar; the calls are read out of the model's text (Hermes-style ``<tool_call>``
JSON) by api/tool_stream.py.

Pure functions and small state, no I/O. The prompt side runs in ``params.chat_prompt_ids``, which
the router calls too, so a prompt with tools hashes to the blocks the engine caches.

A model whose chat template takes ``tools`` gets them as the template's own argument; any other
template (the default model's ChatML has none) gets the generic format below: the functions as
JSON lines in the system message, earlier calls as ``<tool_call>`` blocks in assistant turns and
results as ``<tool_response>`` blocks in ``tool`` turns.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvmesh.engine.api import errors

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128


@dataclass(frozen=True)
class Function:
    name: str
    description: str
    parameters: dict[str, Any]

    def definition(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolSetup:
    """What a request's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` ask for.

    ``choice`` is "auto" (the model decides; calls are parsed from its text), "required" (at least
    one call, by grammar) or "named" (exactly a call of ``named``, by grammar); "none" never
    yields a ToolSetup.
    """

    functions: tuple[Function, ...]
    choice: str
    named: str | None = None
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "named")


def _function(i: int, tool: Any) -> Function:
    where = f"tools.{i}"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(
            tool.get("function"), dict):
        raise errors.invalid_request(f"{where} must be {{'type': 'function', 'function': {{...}}}}", where)
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not name or len(name) > 64 or not all(c.isalnum() or c in "_-" for c in name):
        raise errors.invalid_request(f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-'",
                                     f"{where}.function.name")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise errors.invalid_request(f"{where}.function.parameters must be a JSON schema object",
                                     f"{where}.function.parameters")
    desc = fn.get("description") or ""
    if not isinstance(desc, str):
        raise errors.invalid_request(f"{where}.function.description must be a string", f"{where}.function.description")
    return Function(name, desc, params)


def parse_tools(tools: Any, tool_choice: Any, parallel: bool | None) -> ToolSetup | None:
    """The request's tool setup, None when no tool may be called; a 400 naming the field for a
    malformed tool, a duplicate name, or a ``tool_choice`` naming a function not in ``tools``."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise errors.invalid_request("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise errors.invalid_request(f"tools must be a list of at most {MAX_TOOLS} functions", "tools")
    functions = tuple(_function(i, t) for i, t in enumerate(tools))
    names = [f.name for f in functions]
    if len(set(names)) < len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise errors.invalid_request(f"tools names function {dup!r} twice", "tools")
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none" or not functions:
        return None
    if choice in ("auto", "required"):
        return ToolSetup(functions, choice, None, parallel is not False)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise errors.invalid_request(f"tool_choice names function {name!r}, which is not in tools "
                                         f"({', '.join(names)})", "tool_choice")
        return ToolSetup(functions, "named", name, False)
    raise errors.invalid_request("tool_choice must be 'none', 'auto', 'required' or "
                                 "{'type': 'function', 'function': {'name': ...}}", "tool_choice")


def system_text(functions: tuple[Function, ...]) -> str:
    lines = "\n".join(json.dumps(f.definition()["function"], ensure_ascii=False) for f in functions)
    return ("You can call functions. Their signatures, one JSON object per line:\n"
            f"<tools>\n{lines}\n</tools>\n"
            f"To call one, answer with {OPEN}{{\"name\": <function name>, \"arguments\": <JSON object>}}{CLOSE}, "
            "one block per call.")


def _call_text(call: Any, i: int) -> str:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise errors.invalid_request(f"messages: tool_calls.{i} needs function.name", "messages")
    args = fn.get("arguments", "{}")
    try:
        parsed = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        raise errors.invalid_request(f"messages: tool_calls.{i}.function.arguments is not JSON", "messages") from None
    return f"{OPEN}{json.dumps({'name': fn['name'], 'arguments': parsed}, ensure_ascii=False)}{CLOSE}"


def render_history(messages: list[dict[str, Any]], raw: list[Any], setup: ToolSetup | None,
                   template_takes_tools: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Messages (and template keyword arguments) for the chat template, tool turns included.

    ``messages`` are the plain-text messages of ``params.chat_messages``; ``raw`` the request's
    messages, for their ``tool_calls``.
    """
    out = []
    for m, r in zip(messages, raw):
        calls = getattr(r, "tool_calls", None)
        if template_takes_tools:
            out.append({**m, **({"tool_calls": calls} if calls else {})})
            continue
        if calls:
            text = "".join(_call_text(c, i) for i, c in enumerate(calls))
            m = {**m, "content": (m["content"] + "\n" if m["content"] else "") + text}
        elif m["role"] == "tool":
            m = {**m, "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        out.append(m)
    if setup is None:
        return out, {}
    if template_takes_tools:
        return out, {"tools": [f.definition() for f in setup.functions]}
    prompt = system_text(setup.functions)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, {}


def grammar(setup: ToolSetup) -> str:
    """A Lark grammar (llguidance) for ``required`` / named choices: one or more ``<tool_call>``
    blocks whose JSON names a function and carries arguments valid under its schema. The JSON is
    compact, as structured outputs' is (structured/grammar.py), so a small model cannot spend
    ``max_tokens`` on whitespace inside a call."""
    fns = [f for f in setup.functions if setup.named in (None, f.name)]
    schemas = [{"type": "object", "properties": {"name": {"const": f.name}, "arguments": f.parameters},
                "required": ["name", "arguments"], "additionalProperties": False} for f in fns]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
    body = json.dumps(schema, separators=(",", ":"))
    repeat = ' ("\\n" call)*' if setup.parallel else ""
    return f'start: call{repeat}\ncall: "{OPEN}" obj "{CLOSE}"\nobj: %json {body}\n'
