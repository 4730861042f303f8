"""Tool calls as a grammar: what a node constrains an answer to for OpenAI function tools.

A call is written, as Hermes- and Qwen-style chat templates ask a model to write it:

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

`tool_call_grammar(tools, tool_choice, parallel_tool_calls)` builds the GrammarSpec
(kind "structural_tag") a GenerateParams carries:

    "required"           one call or more (one unless parallel), separated by a newline,
                         nothing else; each names a defined function and its arguments
                         match that function's `parameters` schema
    {"type": "function", "function": {"name": N}}
                         the same, N alone
    "auto"               free text, in which a call, once "<tool_call>" begins it, is held
                         to the grammar to its end; the answer may hold no call
    "none"               None: no grammar (the tools are not offered)

With `response_schema` (JSON mode or a JSON Schema response format beside tools), the free
text of "auto" is replaced by one JSON value of that schema: the answer is either that, or
calls. `parse_tool_calls(text)` reads the calls back out of an answer.

Pure Python, no torch: the gateway builds these.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from common.node_api import GrammarSpec

CALL_BEGIN = "<tool_call>"
CALL_END = "</tool_call>"
_CALL = re.compile(re.escape(CALL_BEGIN) + r"(.*?)" + re.escape(CALL_END), re.DOTALL)
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


class ToolGrammarError(ValueError):
    """Tools or a tool choice that no grammar can be built for (the client's mistake)."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """{name: parameters schema} of the function tools, in their order."""
    found: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        if tool.get("type", "function") != "function" or not isinstance(tool.get("function"), dict):
            raise ToolGrammarError(f"tools[{i}] is not a function tool")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ToolGrammarError(f"tools[{i}].function.name must be a non-empty string")
        if name in found:
            raise ToolGrammarError(f"tools[{i}]: function {name!r} is defined twice")
        parameters = function.get("parameters", _ANY_OBJECT)
        if not isinstance(parameters, dict):
            raise ToolGrammarError(f"tools[{i}].function.parameters must be a JSON Schema")
        found[name] = parameters
    return found


def _call_tag(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    begin = f"{CALL_BEGIN}{{{json.dumps('name')}: {json.dumps(name)}, {json.dumps('arguments')}: "
    return {
        "type": "tag",
        "begin": begin,
        "content": {"type": "json_schema", "json_schema": parameters, "max_whitespace_cnt": 1},
        "end": "}" + CALL_END,
    }


def tool_call_grammar(
    tools: list[dict[str, Any]],
    tool_choice: str | dict[str, Any] = "auto",
    parallel_tool_calls: bool = True,
    response_schema: dict[str, Any] | None = None,
) -> GrammarSpec | None:
    """The grammar for OpenAI `tools` and `tool_choice` (module docstring); None where
    nothing is constrained. ToolGrammarError naming what is wrong in them."""
    functions = _functions(tools)
    if tool_choice == "none":
        return None
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if tool_choice.get("type") != "function" or name not in functions:
            raise ToolGrammarError(f"tool_choice names no defined function: {tool_choice!r}")
        functions = {name: functions[name]}
        tool_choice = "required"
    if not functions:
        raise ToolGrammarError("tools must hold at least one function")
    tags = [_call_tag(name, parameters) for name, parameters in functions.items()]
    calls: dict[str, Any] = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": "\n",
        "at_least_one": True,
        "stop_after_first": not parallel_tool_calls,
    }
    if tool_choice == "required":
        fmt = calls
    elif tool_choice == "auto":
        if response_schema is not None:
            answer = {
                "type": "json_schema",
                "json_schema": response_schema,
                "max_whitespace_cnt": 1,
            }
            fmt = {"type": "or", "elements": [answer, calls]}
        else:
            fmt = {
                "type": "triggered_tags",
                "triggers": [CALL_BEGIN],
                "tags": tags,
                "at_least_one": False,
                "stop_after_first": not parallel_tool_calls,
            }
    else:
        raise ToolGrammarError(f"unknown tool_choice {tool_choice!r}")
    return GrammarSpec(
        kind="structural_tag", value=json.dumps({"type": "structural_tag", "format": fmt})
    )


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """The text of an answer outside its calls, and the calls in it, in order. A call
    that is not `{"name": str, "arguments": object}` JSON raises ToolGrammarError (one
    generated under the grammar always is)."""
    calls = []
    for match in _CALL.finditer(text):
        try:
            body = json.loads(match.group(1))
        except ValueError as exc:
            raise ToolGrammarError(f"a tool call that is not JSON: {exc}") from None
        if (
            not isinstance(body, dict)
            or not isinstance(body.get("name"), str)
            or not isinstance(body.get("arguments"), dict)
        ):
            raise ToolGrammarError("a tool call is {'name': str, 'arguments': object}")
        calls.append(ToolCall(body["name"], body["arguments"]))
    return _CALL.sub("", text).strip(), calls
