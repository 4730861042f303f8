"""Structured outputs, tool calls, logprobs and n through the real gateway and the real
SmolLM2 node, with the official openai client and Workers AI's REST shape: what comes back
as JSON or as a tool call is valid by construction, even from a 135M-parameter model."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.conftest import ACCOUNT_ID, SMOLLM2
from tests.json_schemas import PERSON

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ASK = [{"role": "user", "content": "Describe a made-up person as JSON."}]
PERSON_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": PERSON, "strict": True},
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 20}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a timezone.",
                                      "parameters": TIME}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.api_key, max_retries=0)


def streamed_choices(stream: Any) -> dict[int, dict[str, Any]]:
    """index -> {"content", "tool_calls" (reassembled from their deltas), "finish_reason"}."""
    choices: dict[int, dict[str, Any]] = {}
    for chunk in stream:
        for choice in chunk.choices:
            got = choices.setdefault(
                choice.index, {"content": "", "tool_calls": {}, "finish_reason": None}
            )
            got["content"] += choice.delta.content or ""
            for call in choice.delta.tool_calls or ():
                into = got["tool_calls"].setdefault(call.index, {"name": "", "arguments": ""})
                if call.function.name:
                    into["name"] += call.function.name
                into["arguments"] += call.function.arguments or ""
            got["finish_reason"] = choice.finish_reason or got["finish_reason"]
    return choices


def test_json_schema_answers_all_validate_whole_and_streamed(client) -> None:
    kwargs: dict[str, Any] = {
        "model": SMOLLM2, "messages": ASK, "response_format": PERSON_FORMAT,
        "temperature": 1.0, "n": 10, "max_tokens": 150,
    }  # fmt: skip
    whole = client.chat.completions.create(**kwargs, seed=11)  # ten answers whole
    assert len(whole.choices) == 10
    for choice in whole.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    streamed = streamed_choices(client.chat.completions.create(**kwargs, seed=12, stream=True))
    assert sorted(streamed) == list(range(10))  # and ten streamed
    for got in streamed.values():
        assert got["finish_reason"] == "stop"
        jsonschema.validate(json.loads(got["content"]), PERSON)
    answers = [c.message.content for c in whole.choices] + [g["content"] for g in streamed.values()]
    assert len(set(answers)) > 10  # sampled, not one answer twenty times
    # One prompt, one seed: a stream carries the answers a whole request gets.
    again = streamed_choices(
        client.chat.completions.create(**kwargs | {"n": 2}, seed=11, stream=True)
    )
    assert [again[i]["content"] for i in range(2)] == [c.message.content for c in whole.choices[:2]]


def test_workers_ai_json_mode_answers_validate_whole_and_streamed(stack) -> None:
    url = f"{stack.url}/client/v4/accounts/{ACCOUNT_ID}/ai/run/{SMOLLM2}"
    auth = {"authorization": f"Bearer {stack.api_key}"}

    def ask(i: int) -> str:
        body = {"messages": ASK, "temperature": 1.0, "seed": i, "max_tokens": 150,
                "response_format": {"type": "json_schema", "json_schema": PERSON},
                "stream": i % 2 == 1}  # fmt: skip
        response = httpx.post(url, json=body, headers=auth, timeout=120)
        assert response.status_code == 200, response.text
        if i % 2 == 0:
            return str(response.json()["result"]["response"])
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return "".join(json.loads(e)["response"] for e in events[:-1])

    with ThreadPoolExecutor(5) as pool:  # what the test node's KV pool holds at once
        answers = list(pool.map(ask, range(20)))
    for answer in answers:
        jsonschema.validate(json.loads(answer), PERSON)


def check_call(call: dict[str, Any]) -> None:
    assert call["name"] in SCHEMAS, call
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_required_tool_calls_are_valid_and_their_deltas_reassemble_to_them(client) -> None:
    kwargs: dict[str, Any] = {
        "model": SMOLLM2, "messages": WEATHER_ASK, "tools": TOOLS, "tool_choice": "required",
        "temperature": 1.0, "n": 10, "max_tokens": 120, "parallel_tool_calls": False,
    }  # fmt: skip
    calls = []
    for seed in (5, 6):  # 2 x 10 choices: twenty sampled calls
        for choice in client.chat.completions.create(**kwargs, seed=seed).choices:
            assert choice.finish_reason == "tool_calls"
            assert choice.message.content is None
            assert choice.message.tool_calls
            for call in choice.message.tool_calls:
                assert call.type == "function" and call.id.startswith("call_")
                check_call({"name": call.function.name, "arguments": call.function.arguments})
            calls.append(
                [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
            )
    # One prompt, one seed: the streamed deltas reassemble to the calls a whole answer has.
    streamed = streamed_choices(
        client.chat.completions.create(**kwargs | {"n": 3}, seed=5, stream=True)
    )
    for i in range(3):
        got = streamed[i]
        assert (got["content"], got["finish_reason"]) == ("", "tool_calls")
        reassembled = [(c["name"], c["arguments"]) for _, c in sorted(got["tool_calls"].items())]
        assert reassembled == calls[i]


def test_a_named_function_is_the_one_called(client) -> None:
    answer = client.chat.completions.create(
        model=SMOLLM2, messages=WEATHER_ASK, tools=TOOLS, max_tokens=120,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )  # fmt: skip
    (call,) = answer.choices[0].message.tool_calls
    check_call({"name": call.function.name, "arguments": call.function.arguments})
    assert call.function.name == "get_time"


def test_a_two_turn_conversation_with_a_tool_result_completes(client) -> None:
    first = client.chat.completions.create(
        model=SMOLLM2, messages=WEATHER_ASK, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=120,
    )  # fmt: skip
    message = first.choices[0].message
    (call,) = message.tool_calls
    conversation = [
        *WEATHER_ASK,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'},
    ]
    second = client.chat.completions.create(
        model=SMOLLM2, messages=conversation, tools=TOOLS, max_tokens=40
    )
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length")
    assert answer.message.tool_calls is None
    assert answer.message.content
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result


def test_auto_may_answer_in_text(client) -> None:
    answer = client.chat.completions.create(
        model=SMOLLM2, messages=[{"role": "user", "content": "Say hello to Anna."}],
        tools=TOOLS, tool_choice="auto", temperature=1.0, seed=3, n=8, max_tokens=24,
    )  # fmt: skip
    texts = [c for c in answer.choices if c.message.tool_calls is None]
    assert texts, [c.message for c in answer.choices]
    for choice in texts:
        assert choice.message.content and "<tool_call>" not in choice.message.content
        assert choice.finish_reason in ("stop", "length")
    for choice in answer.choices:
        for call in choice.message.tool_calls or ():
            check_call({"name": call.function.name, "arguments": call.function.arguments})


def test_json_mode_and_tools_in_one_request(client) -> None:
    answer = client.chat.completions.create(
        model=SMOLLM2, messages=WEATHER_ASK, tools=TOOLS, response_format={"type": "json_object"},
        temperature=1.0, seed=9, n=6, max_tokens=120, parallel_tool_calls=False,
    )  # fmt: skip
    for choice in answer.choices:
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            for call in choice.message.tool_calls:
                check_call({"name": call.function.name, "arguments": call.function.arguments})
        else:
            assert choice.finish_reason == "stop"
            assert isinstance(json.loads(choice.message.content), dict)


def test_workers_ai_tools_answer_tool_calls_in_its_result_shape(stack) -> None:
    url = f"{stack.url}/client/v4/accounts/{ACCOUNT_ID}/ai/run/{SMOLLM2}"
    tools = [{"name": "get_weather", "description": "Weather in a city.", "parameters": WEATHER}]
    body = {"messages": WEATHER_ASK, "tools": tools, "max_tokens": 120}
    auth = {"authorization": f"Bearer {stack.api_key}"}
    response = httpx.post(url, json=body, headers=auth, timeout=120)
    assert response.status_code == 200, response.text
    result = response.json()["result"]
    for call in result.get("tool_calls", []):
        assert call["name"] == "get_weather"
        jsonschema.validate(call["arguments"], WEATHER)
    assert result.get("tool_calls") or result["response"]
    assert set(result["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}


def test_logprobs_are_the_sampled_tokens_and_their_alternatives(client) -> None:
    answer = client.chat.completions.create(
        model=SMOLLM2, messages=[{"role": "user", "content": "Name a color."}], max_tokens=8,
        temperature=0, logprobs=True, top_logprobs=3,
    )  # fmt: skip
    choice = answer.choices[0]
    content = choice.logprobs.content
    assert len(content) == answer.usage.completion_tokens
    assert "".join(t.token for t in content) == choice.message.content
    for token in content:
        assert token.logprob <= 0.0
        assert len(token.top_logprobs) == 3
        # greedy: the token taken is the most likely one
        assert token.top_logprobs[0].token == token.token
        assert token.top_logprobs[0].logprob == pytest.approx(token.logprob)
        assert [t.logprob for t in token.top_logprobs] == sorted(
            (t.logprob for t in token.top_logprobs), reverse=True
        )
        assert token.bytes == list(token.token.encode())
    streamed = client.chat.completions.create(
        model=SMOLLM2, messages=[{"role": "user", "content": "Name a color."}], max_tokens=8,
        temperature=0, logprobs=True, top_logprobs=3, stream=True,
    )  # fmt: skip
    tokens = [
        t for chunk in streamed for c in chunk.choices if c.logprobs for t in c.logprobs.content
    ]
    assert [(t.token, t.logprob) for t in tokens] == [(t.token, t.logprob) for t in content]


def test_completion_logprobs_and_n_choices(client) -> None:
    answer = client.completions.create(
        model=SMOLLM2, prompt="1, 2, 3,", max_tokens=4, temperature=0.8, seed=7, n=3, logprobs=2
    )
    assert [c.index for c in answer.choices] == [0, 1, 2]
    single = client.completions.create(model=SMOLLM2, prompt="1, 2, 3,", max_tokens=4)
    # the prompt is counted once; every choice's tokens are billed
    assert answer.usage.prompt_tokens == single.usage.prompt_tokens
    assert answer.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in answer.choices)
    for choice in answer.choices:
        assert "".join(choice.logprobs.tokens) == choice.text
        assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
        assert choice.logprobs.text_offset[0] == 0


def test_n_seeded_answers_are_reproducible_and_distinct(client) -> None:
    def ask() -> list[str]:
        answer = client.chat.completions.create(
            model=SMOLLM2, messages=[{"role": "user", "content": "Tell me a word."}],
            temperature=1.0, seed=42, n=3, max_tokens=8,
        )  # fmt: skip
        return [c.message.content for c in answer.choices]

    first = ask()
    assert len(first) == 3 and ask() == first
    assert len(set(first)) > 1
