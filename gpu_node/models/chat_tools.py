"""Tools, tool calls and tool results in a conversation, as a chat template is given them.

A template that knows tools (its source reads `tools`) renders them itself, given what
transformers gives it: `tools=[{"type": "function", "function": {...}}, ...]`, an
assistant turn's calls as `tool_calls: [{"type": "function", "function": {"name",
"arguments": {...}}}]`, and a result as `{"role": "tool", "content", "tool_call_id"}`.

A template that does not (SmolLM2's, Gemma 3's) gets the default rendering, plain text in
the turns every template knows, in the form the tool-call grammar holds answers to
(common/tool_grammar.py):

    system     what the functions are and how to call one, before the conversation's own
               system text, in one system turn
    assistant  its text, then each call on its own line:
               <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>
    tool       a user turn: <tool_response>{"name": ..., "content": ...}</tool_response>,
               the results of consecutive tool turns in one turn
"""

from __future__ import annotations

import json
from typing import Any

from gpu_node.errors import InvalidRequestError

TOOLS_PREAMBLE = (
    "You may call functions to answer. To call one, reply with\n"
    '<tool_call>{"name": <function name>, "arguments": <arguments as a JSON object>}'
    "</tool_call>\n"
    "and nothing else; the result comes back in <tool_response></tool_response>. "
    "The functions:\n"
)


def knows_tools(template: str) -> bool:
    """Whether a chat template renders tools itself."""
    return "tools" in template


def for_template(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, template: str
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra names for the template) that render `messages` and `tools` with
    `template` (module docstring). Messages are {"role", "content"} with, where they made
    or answer calls, "tool_calls" ([{"name", "arguments": JSON text}]) and "tool_call_id"."""
    has_calls = any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
    if not tools and not has_calls:
        return messages, {}
    if knows_tools(template):
        return [_native(m) for m in messages], ({"tools": tools} if tools else {})
    return _default(messages, tools or []), {}


def _arguments(call: dict[str, Any]) -> dict[str, Any]:
    try:
        arguments = json.loads(call["arguments"])
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        raise InvalidRequestError(
            f"the arguments of a call to {call['name']!r} are not a JSON object"
        )
    return arguments


def _native(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    return message | {
        "tool_calls": [
            {"type": "function", "function": {"name": c["name"], "arguments": _arguments(c)}}
            for c in calls
        ]
    }


def _default(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if tools:
        lines = [
            json.dumps(
                {
                    "name": t["function"]["name"],
                    "description": t["function"].get("description", ""),
                    "parameters": t["function"].get("parameters", {"type": "object"}),
                },
                ensure_ascii=False,
            )
            for t in tools
        ]
        system = TOOLS_PREAMBLE + "\n".join(lines)
        if messages and messages[0]["role"] == "system":
            system += "\n\n" + messages[0]["content"]
            messages = messages[1:]
        out.append({"role": "system", "content": system})
    names = {}  # a call's id -> its function's name, for the result's turn
    for message in messages:
        role = message["role"]
        if role == "assistant" and message.get("tool_calls"):
            written = [
                "<tool_call>"
                + json.dumps({"name": c["name"], "arguments": _arguments(c)}, ensure_ascii=False)
                + "</tool_call>"
                for c in message["tool_calls"]
            ]
            text = "\n".join([message["content"], *written] if message["content"] else written)
            out.append({"role": "assistant", "content": text})
            for i, call in enumerate(message["tool_calls"]):
                names[call.get("id", i)] = call["name"]
        elif role == "tool":
            result: dict[str, Any] = {"content": message["content"]}
            if (name := names.get(message.get("tool_call_id"))) is not None:
                result = {"name": name} | result
            text = "<tool_response>" + json.dumps(result, ensure_ascii=False) + "</tool_response>"
            previous = out[-1] if out else None
            if previous is not None and previous.get("_results"):
                previous["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text, "_results": True})
        else:
            out.append({"role": role, "content": message["content"]})
    return [{k: v for k, v in m.items() if k != "_results"} for m in out]
