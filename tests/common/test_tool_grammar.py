"""Tool-call grammars as the gateway builds them: their shape, their refusals, and calls
read back out of an answer (sampling under them: tests/gpu_node/engine/test_grammar.py)."""

from __future__ import annotations

import json

import pytest

from common.tool_grammar import ToolCall, ToolGrammarError, parse_tool_calls, tool_call_grammar

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
ADD = {"type": "function", "function": {"name": "add"}}


def format_of(spec) -> dict:
    assert spec.kind == "structural_tag"
    tag = json.loads(spec.value)
    assert tag["type"] == "structural_tag"
    return tag["format"]


def test_required_is_calls_alone_each_held_to_its_functions_schema() -> None:
    fmt = format_of(tool_call_grammar([WEATHER, ADD], "required", parallel_tool_calls=False))
    assert fmt["type"] == "tags_with_separator"
    assert (fmt["at_least_one"], fmt["stop_after_first"]) == (True, True)
    weather, add = fmt["tags"]
    assert weather["begin"] == '<tool_call>{"name": "get_weather", "arguments": '
    assert weather["end"] == "}</tool_call>"
    assert weather["content"]["json_schema"] == WEATHER["function"]["parameters"]
    assert add["content"]["json_schema"] == {"type": "object"}


def test_a_named_function_is_the_only_one_allowed() -> None:
    choice = {"type": "function", "function": {"name": "add"}}
    fmt = format_of(tool_call_grammar([WEATHER, ADD], choice))
    assert [t["begin"] for t in fmt["tags"]] == ['<tool_call>{"name": "add", "arguments": ']
    assert fmt["at_least_one"] and not fmt["stop_after_first"]


def test_auto_is_free_text_with_triggered_calls_and_none_is_no_grammar() -> None:
    fmt = format_of(tool_call_grammar([WEATHER], "auto"))
    assert fmt["type"] == "triggered_tags" and fmt["triggers"] == ["<tool_call>"]
    assert not fmt["at_least_one"]
    assert tool_call_grammar([WEATHER], "none") is None


def test_auto_beside_a_response_schema_is_that_json_or_calls() -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}}
    fmt = format_of(tool_call_grammar([WEATHER], "auto", response_schema=schema))
    assert fmt["type"] == "or"
    assert fmt["elements"][0]["json_schema"] == schema
    assert fmt["elements"][1]["type"] == "tags_with_separator"


@pytest.mark.parametrize(
    "tools, choice, words",
    [
        ([], "required", "at least one function"),
        ([WEATHER, WEATHER], "auto", "defined twice"),
        ([{"type": "retrieval"}], "auto", "not a function tool"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "no defined function"),
        ([WEATHER], "sometimes", "unknown tool_choice"),
    ],
)
def test_tools_no_grammar_fits_are_refused_by_name(tools, choice, words) -> None:
    with pytest.raises(ToolGrammarError, match=words):
        tool_call_grammar(tools, choice)


def test_calls_are_read_back_out_of_an_answer() -> None:
    text = (
        'Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
        '</tool_call>\n<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    )
    assert parse_tool_calls(text) == (
        "Let me look.",
        [ToolCall("get_weather", {"city": "Oslo"}), ToolCall("add", {})],
    )
    with pytest.raises(ToolGrammarError):
        parse_tool_calls("<tool_call>{oops}</tool_call>")


def test_importable_without_torch() -> None:
    import subprocess
    import sys

    code = "import sys, common.tool_grammar; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
