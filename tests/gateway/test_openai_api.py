"""The official `openai` client against the gateway, with a real node behind it."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.conftest import ACCOUNT_ID, SMOLLM2, also_served, chat_prompt_ids, run_on_engine

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.api_key, max_retries=0)


def test_chat_completion_returns_the_engines_text_and_exact_usage(stack, engine, client) -> None:
    reference = run_on_engine(engine, chat_prompt_ids(engine, MESSAGES), max_tokens=8)
    completion = client.chat.completions.create(
        model=SMOLLM2, messages=MESSAGES, max_tokens=8, temperature=0
    )
    assert completion.choices[0].message.content == reference.text
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].finish_reason == "length"
    assert completion.model == SMOLLM2
    assert completion.object == "chat.completion"
    assert completion.id.startswith("chatcmpl-")
    assert (
        completion.usage.prompt_tokens,
        completion.usage.completion_tokens,
        completion.usage.total_tokens,
    ) == (
        reference.prompt_tokens,
        8,
        reference.prompt_tokens + 8,
    )
    event = stack.sink.events[-1]
    assert (event.account_id, event.model, event.node_id, event.status) == (
        ACCOUNT_ID,
        SMOLLM2,
        "node-1",
        "ok",
    )
    assert (event.input_tokens, event.output_tokens) == (reference.prompt_tokens, 8)
    assert event.request_id == completion.id.removeprefix("chatcmpl-")


def test_streaming_chat_with_include_usage(stack, engine, client) -> None:
    reference = run_on_engine(engine, chat_prompt_ids(engine, MESSAGES), max_tokens=8)
    stream = client.chat.completions.create(
        model="smollm2",  # the alias works too
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert len({c.id for c in chunks}) == 1
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference.text
    last_choice, usage_chunk = chunks[-2:]
    assert last_choice.choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks[:-1])
    assert usage_chunk.choices == []
    assert (usage_chunk.usage.prompt_tokens, usage_chunk.usage.completion_tokens) == (
        reference.prompt_tokens,
        8,
    )


def test_stop_strings_end_the_answer(engine, client) -> None:
    reference = run_on_engine(engine, chat_prompt_ids(engine, MESSAGES), max_tokens=8)
    stop = reference.text.split()[1]  # a word the greedy answer contains
    completion = client.chat.completions.create(
        model=SMOLLM2, messages=MESSAGES, max_tokens=8, temperature=0, stop=[stop]
    )
    assert completion.choices[0].finish_reason == "stop"
    assert stop not in completion.choices[0].message.content
    assert reference.text.startswith(completion.choices[0].message.content)


def test_seeded_sampling_is_reproducible(client) -> None:
    answers = {
        client.chat.completions.create(
            model=SMOLLM2, messages=MESSAGES, max_tokens=6, temperature=1.0, seed=7
        )
        .choices[0]
        .message.content
        for _ in range(2)
    }
    assert len(answers) == 1


def test_completions_use_the_raw_prompt(engine, client) -> None:
    prompt = "The capital of France is"
    reference = run_on_engine(engine, engine.tokenizer.encode(prompt), max_tokens=5)
    completion = client.completions.create(
        model=SMOLLM2, prompt=prompt, max_tokens=5, temperature=0
    )
    assert completion.choices[0].text == reference.text
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (
        reference.prompt_tokens,
        5,
    )
    streamed = client.completions.create(
        model=SMOLLM2, prompt=prompt, max_tokens=5, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == reference.text


def test_an_alias_is_answered_under_the_models_catalog_id(client) -> None:
    """As OpenAI names the snapshot that served a request, whatever alias asked for it."""
    chat = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=1)
    assert chat.model == SMOLLM2
    chunks = list(
        client.completions.create(model="smollm2", prompt="Hi", max_tokens=1, stream=True)
    )
    assert {c.model for c in chunks} == {SMOLLM2}


def test_models_list_and_account_scoped_base_url(stack) -> None:
    scoped = openai.OpenAI(
        base_url=f"{stack.url}/client/v4/accounts/{ACCOUNT_ID}/ai/v1",
        api_key=stack.api_key,
        max_retries=0,
    )
    assert [m.id for m in scoped.models.list()] == [SMOLLM2]  # moe-small: unserved
    with also_served(stack, "moe-small", "/srv/models/Qwen3-0.6B", max_request_tokens=40960):
        listed = {m.id: m.model_extra["context_window"] for m in scoped.models.list()}
        assert listed == {SMOLLM2: 1024, "@cf/edgeserve/moe-small": 8192,
                          "@cf/local/qwen3-0.6b": 40960}  # fmt: skip
        for name in ("qwen3-0.6b", "/srv/models/Qwen3-0.6B", "@cf/local/qwen3-0.6b"):
            assert scoped.models.retrieve(name).id == "@cf/local/qwen3-0.6b"
    missing = httpx.get(
        f"{stack.url}/v1/models/qwen3-0.6b", headers={"authorization": f"Bearer {stack.api_key}"}
    )
    assert missing.status_code == 404
    completion = scoped.chat.completions.create(
        model=SMOLLM2, messages=MESSAGES, max_tokens=2, temperature=0
    )
    assert completion.usage.completion_tokens == 2


def error_of(response: httpx.Response) -> tuple[int, dict]:
    assert response.headers["content-type"] == "application/json"
    assert len(response.headers["x-request-id"]) == 32
    return response.status_code, response.json()


def test_missing_and_wrong_keys_are_401_in_openai_shape(stack) -> None:
    url = f"{stack.url}/v1/chat/completions"
    body = {"model": SMOLLM2, "messages": MESSAGES}
    assert error_of(httpx.post(url, json=body)) == (
        401,
        {
            "error": {
                "message": "missing API key: send 'Authorization: Bearer <API key>'",
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_api_key",
            }
        },
    )
    wrong = httpx.post(url, json=body, headers={"authorization": "Bearer es-nope"})
    assert error_of(wrong) == (
        401,
        {
            "error": {
                "message": "invalid API key",
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_api_key",
            }
        },
    )
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{stack.url}/v1", api_key="es-nope", max_retries=0).models.list()


def test_another_accounts_path_is_403_in_openai_shape(stack) -> None:
    url = f"{stack.url}/client/v4/accounts/{ACCOUNT_ID}/ai/v1/chat/completions"
    response = httpx.post(
        url,
        json={"model": SMOLLM2, "messages": MESSAGES},
        headers={"authorization": f"Bearer {stack.other_key}"},
    )
    assert error_of(response) == (
        403,
        {
            "error": {
                "message": f"this API key may not act for account '{ACCOUNT_ID}'",
                "type": "permission_error",
                "param": None,
                "code": "forbidden",
            }
        },
    )


@pytest.mark.parametrize(
    ("body", "status", "message", "param", "code"),
    [
        (
            b"{not json",
            400,
            "malformed JSON body: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)",
            None,
            None,
        ),
        (b"[1, 2]", 400, "the body must be a JSON object", None, None),
        (
            b'{"model": "smollm2", "messages": [{"role": "user", "content": "hi \\ud800"}]}',
            400,
            "malformed JSON body: a string holds an unpaired UTF-16 surrogate",
            None,
            None,
        ),
        (
            {"model": SMOLLM2, "messages": "hi"},
            400,
            "invalid request: messages: Input should be a valid list",
            "messages",
            None,
        ),
        (
            {"model": SMOLLM2, "messages": MESSAGES, "max_tokens": -5},
            400,
            "invalid request: max_tokens: Input should be greater than or equal to 1",
            "max_tokens",
            None,
        ),
        (
            {"model": SMOLLM2, "messages": MESSAGES, "max_tokens": "many"},
            400,
            "invalid request: max_tokens: Input should be a valid integer",
            "max_tokens",
            None,
        ),
        (
            {"model": SMOLLM2, "messages": MESSAGES, "seed": 2**64},  # past torch's seeds
            400,
            "invalid request: seed: Input should be less than or equal to 9223372036854775807",
            "seed",
            None,
        ),
        (
            {"model": "gpt-9", "messages": MESSAGES},
            404,
            "no such model: 'gpt-9'",
            "model",
            "model_not_found",
        ),
        (
            {"model": SMOLLM2, "messages": MESSAGES, "n": 17},
            400,
            "'n' is at most 16",
            "n",
            "unsupported_parameter",
        ),
        (
            {"model": SMOLLM2, "messages": MESSAGES, "tools": [{"type": "function"}]},
            400,
            "invalid request: tools.0: a tool needs 'function' (or 'name')",
            "tools.0",
            None,
        ),
        (
            {"model": SMOLLM2, "messages": MESSAGES, "logprobs": 2},
            400,
            "'logprobs' is true or false",
            "logprobs",
            None,
        ),
        (
            {"model": SMOLLM2, "messages": MESSAGES, "stop": ["a", "b", "c", "d", "e"]},
            400,
            "invalid request: stop: takes at most 4 sequences",
            "stop",
            None,
        ),
        (
            {"model": SMOLLM2, "messages": MESSAGES, "stop": ""},
            400,
            "invalid request: stop: sequences must not be empty",
            "stop",
            None,
        ),
        (
            {"model": SMOLLM2, "messages": MESSAGES, "modalities": ["text", "audio"]},
            400,
            "only the 'text' modality is supported",
            "modalities",
            "unsupported_parameter",
        ),
        (
            {"model": SMOLLM2, "messages": MESSAGES, "audio": {"voice": "alloy", "format": "wav"}},
            400,
            "'audio' is not supported",
            "audio",
            "unsupported_parameter",
        ),
        (
            {"model": SMOLLM2, "messages": MESSAGES, "web_search_options": {}},
            400,
            "'web_search_options' is not supported",
            "web_search_options",
            "unsupported_parameter",
        ),
        (
            {"model": SMOLLM2, "messages": MESSAGES, "reasoning_effort": "low"},
            400,
            "'reasoning_effort' is not supported",
            "reasoning_effort",
            "unsupported_parameter",
        ),
        (
            {"model": SMOLLM2, "messages": MESSAGES, "max_completion_tokens": 6000},
            400,
            "max_completion_tokens (6000) leaves no room for a prompt in the context window of "
            "1024 tokens",
            "max_completion_tokens",
            "context_length_exceeded",
        ),
        (
            {
                "model": SMOLLM2,
                "messages": [{"role": "user", "content": "word " * 1200}],
                "max_tokens": 10,
            },
            400,
            None,
            "messages",
            "context_length_exceeded",
        ),
    ],
)
def test_bad_requests_are_4xx_with_a_message_and_the_server_keeps_serving(
    stack, body, status, message, param, code
) -> None:
    headers = {"authorization": f"Bearer {stack.api_key}", "content-type": "application/json"}
    url = f"{stack.url}/v1/chat/completions"
    response = (
        httpx.post(url, content=body, headers=headers)
        if isinstance(body, bytes)
        else httpx.post(url, json=body, headers=headers)
    )
    got_status, got = error_of(response)
    assert got_status == status
    error = got["error"]
    if message is None:  # the node's count of the prompt decides; the message names it
        assert (
            error["message"].startswith("prompt (")
            and "exceeds the context window of 1024 tokens" in error["message"]
        )
    else:
        assert error["message"] == message
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
    ok = httpx.post(
        url,
        json={"model": SMOLLM2, "messages": MESSAGES, "max_tokens": 1},
        headers=headers,
        timeout=30,
    )
    assert ok.status_code == 200


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b'{"x": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", "nested too deeply"),
        (
            b'{"model": "smollm2", "max_tokens": 1' + b"0" * 5000 + b"}",
            "an integer has more than 4300 digits",
        ),
        (  # JSON is UTF-8: the decoder would have guessed UTF-16 from the bytes
            json.dumps({"model": "smollm2", "messages": []}).encode("utf-16"),
            "'utf-8' codec can't decode byte 0xff in position 0: invalid start byte",
        ),
        (
            b"\xef\xbb\xbf" + json.dumps({"model": "smollm2"}).encode(),
            "Unexpected UTF-8 BOM (decode using utf-8-sig): line 1 column 1 (char 0)",
        ),
    ],
    ids=["deep", "long-int", "utf-16", "bom"],
)
def test_json_past_the_decoders_limits_is_a_400_and_the_connection_keeps_serving(
    stack, body, reason
) -> None:
    headers = {"authorization": f"Bearer {stack.api_key}", "content-type": "application/json"}
    with httpx.Client(base_url=stack.url, headers=headers, timeout=30) as http:
        got_status, got = error_of(http.post("/v1/chat/completions", content=body))
        assert (got_status, got) == (
            400,
            {
                "error": {
                    "message": f"malformed JSON body: {reason}",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": None,
                }
            },
        )
        # the same keep-alive connection answers the next request
        ok = http.post(
            "/v1/chat/completions", json={"model": SMOLLM2, "messages": MESSAGES, "max_tokens": 1}
        )
        assert ok.status_code == 200


def test_a_vanishing_temperature_answers_as_greedy_and_fails_no_one(client) -> None:
    """A temperature that overflows float32 logits (1e-300 is 0 there) is the greedy limit,
    not a failed step for every request in the batch."""
    greedy = client.chat.completions.create(
        model=SMOLLM2, messages=MESSAGES, max_tokens=6, temperature=0
    )
    tiny = client.chat.completions.create(
        model=SMOLLM2, messages=MESSAGES, max_tokens=6, temperature=1e-300
    )
    assert tiny.choices[0].message.content == greedy.choices[0].message.content
    assert tiny.usage.completion_tokens == greedy.usage.completion_tokens


def test_unknown_route_and_method_in_openai_shape(stack) -> None:
    assert error_of(httpx.get(f"{stack.url}/v1/nothing")) == (
        404,
        {
            "error": {
                "message": "no route for GET /v1/nothing",
                "type": "invalid_request_error",
                "param": None,
                "code": "not_found",
            }
        },
    )
    assert error_of(httpx.get(f"{stack.url}/v1/chat/completions"))[0] == 405


def test_an_invalid_json_schema_is_a_400_naming_the_problem(stack) -> None:
    headers = {"authorization": f"Bearer {stack.api_key}"}
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
    }
    response = httpx.post(
        f"{stack.url}/v1/chat/completions",
        json={"model": SMOLLM2, "messages": MESSAGES, "response_format": response_format},
        headers=headers,
        timeout=30,
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "response_format")
    assert "nonsense" in error["message"]
