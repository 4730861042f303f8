"""OpenAI's Responses API on loopback, with the official openai client and a real node:
the same tokens as the chat it stands for, typed stream events, JSON formats and tools."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.conftest import ACCOUNT_ID, SMOLLM2

pytestmark = pytest.mark.timeout(120)

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city.",
        "parameters": WEATHER}  # fmt: skip


@pytest.fixture
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.api_key, max_retries=0)


def test_a_response_carries_the_tokens_of_the_chat_it_stands_for(client) -> None:
    response = client.responses.create(
        model=SMOLLM2, instructions="Answer in one word.", input="What color is the sky?",
        max_output_tokens=8, temperature=0,
    )  # fmt: skip
    chat = client.chat.completions.create(
        model=SMOLLM2, max_tokens=8, temperature=0,
        messages=[{"role": "system", "content": "Answer in one word."},
                  {"role": "user", "content": "What color is the sky?"}],
    )  # fmt: skip
    assert response.output_text == chat.choices[0].message.content
    assert response.id.startswith("resp_") and response.object == "response"
    assert (response.model, response.status) == (SMOLLM2, "completed" if chat.choices[
        0].finish_reason == "stop" else "incomplete")  # fmt: skip
    (message,) = response.output
    assert (message.type, message.role, message.content[0].type) == (
        "message", "assistant", "output_text",
    )  # fmt: skip
    assert (response.usage.input_tokens, response.usage.output_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens,
    )  # fmt: skip


def test_a_cut_answer_is_incomplete_for_max_output_tokens(client) -> None:
    response = client.responses.create(
        model=SMOLLM2, input="Tell me a long story.", max_output_tokens=3, temperature=0
    )
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3


def test_the_stream_is_typed_events_that_add_up_to_the_response(client) -> None:
    whole = client.responses.create(
        model=SMOLLM2, input="Name three fruits.", max_output_tokens=12, temperature=0
    )
    events = list(
        client.responses.create(
            model=SMOLLM2, input="Name three fruits.", max_output_tokens=12, temperature=0,
            stream=True,
        )
    )  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added",
    ]  # fmt: skip
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed" if whole.status == "completed" else "response.incomplete",
    ]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_json_schema_format_holds_the_answer(client) -> None:
    person = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 16},
                       "age": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }  # fmt: skip
    response = client.responses.create(
        model=SMOLLM2, input="Invent a person.", max_output_tokens=60, temperature=1.0,
        text={"format": {"type": "json_schema", "name": "person", "schema": person,
                         "strict": True}},
    )  # fmt: skip
    jsonschema.validate(json.loads(response.output_text), person)
    assert response.text.format.type == "json_schema"


def test_function_calls_come_back_as_items_and_their_outputs_continue_the_turn(client) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.responses.create(
        model=SMOLLM2, input=ask, tools=[TOOL], tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=60,
    )  # fmt: skip
    (call,) = first.output
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")
    jsonschema.validate(json.loads(call.arguments), WEATHER)

    streamed = list(
        client.responses.create(
            model=SMOLLM2, input=ask, tools=[TOOL], tool_choice="required",
            parallel_tool_calls=False, max_output_tokens=60, stream=True,
        )
    )  # fmt: skip
    deltas = "".join(
        e.delta for e in streamed if e.type == "response.function_call_arguments.delta"
    )
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert [d.arguments for d in done] == [deltas] == [call.arguments]

    second = client.responses.create(
        model=SMOLLM2, tools=[TOOL], max_output_tokens=20,
        input=[*ask, {"type": "function_call", "call_id": call.call_id, "name": call.name,
                      "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id,
                "output": '{"temperature": 18}'}],
    )  # fmt: skip
    assert second.output[0].type == "message"
    assert second.usage.input_tokens > first.usage.input_tokens


@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        ({"input": "hi", "previous_response_id": "resp_1"},
         "'previous_response_id' is not supported: no response is kept here; send the whole "
         "conversation in 'input'", "previous_response_id"),
        ({"input": []}, "invalid request: input: must not be empty", "input"),
        ({"input": 7}, "invalid request: input: must be a string or a list of input items",
         "input"),
        ({"input": [{"type": "function_call", "call_id": "c"}]},
         "invalid request: input.0: a function_call item needs 'name', 'arguments'", "input.0"),
        ({"input": "hi", "tools": [{"type": "web_search"}]},
         "invalid request: tools.0.type: Input should be 'function'", "tools.0.type"),
    ],
)  # fmt: skip
def test_bad_responses_requests_are_400s_naming_the_field(stack, body, message, param) -> None:
    response = httpx.post(
        f"{stack.url}/client/v4/accounts/{ACCOUNT_ID}/ai/v1/responses",
        json={"model": SMOLLM2, **body},
        headers={"authorization": f"Bearer {stack.api_key}"},
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["message"], error["param"]) == (message, param)


def test_answers_match_the_documented_body(stack) -> None:
    from gateway.response_bodies import ResponseObject

    auth = {"authorization": f"Bearer {stack.api_key}"}
    for body in (
        {"input": "Hi", "max_output_tokens": 4},
        {"input": "Weather in Paris?", "tools": [TOOL], "tool_choice": "required",
         "parallel_tool_calls": False, "max_output_tokens": 60},
    ):  # fmt: skip
        response = httpx.post(
            f"{stack.url}/v1/responses", json={"model": SMOLLM2, **body}, headers=auth, timeout=60
        )
        assert response.status_code == 200
        ResponseObject.model_validate(response.json())
