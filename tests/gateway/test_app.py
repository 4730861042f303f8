"""Gateway behaviour that needs no model: readiness, no capacity, OpenAPI, request ids, no torch."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys

import httpx
import pytest

from gateway.app import create_app
from gateway.keys import MemoryKeyStore
from gateway.settings import GatewaySettings
from scheduler.capacity import CapacityView, LocalCapacityRegistry
from scheduler.placement import LocalReservations, Placer
from tests.conftest import SMOLLM2, ServerThread

KEY = "es-test-key"


def gateway(is_ready=lambda: True, **settings) -> ServerThread:
    keys = MemoryKeyStore()
    asyncio.run(keys.add(KEY, "acct"))
    placer = Placer(CapacityView(LocalCapacityRegistry(), max_age_s=1.0), LocalReservations())
    app = create_app(
        GatewaySettings(internal_token="t", **settings), keys=keys, placer=placer, is_ready=is_ready
    )
    return ServerThread(app).start()


@pytest.fixture(scope="module")
def loading():
    server = gateway(is_ready=lambda: False)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def empty():
    server = gateway()
    yield server
    server.stop()


AUTH = {"authorization": f"Bearer {KEY}"}


def test_a_loading_model_is_503_in_each_dialect(loading) -> None:
    wai = httpx.post(
        f"{loading.url}/client/v4/accounts/acct/ai/run/{SMOLLM2}",
        json={"prompt": "hi"},
        headers=AUTH,
    )
    assert (wai.status_code, wai.headers["retry-after"], wai.json()) == (
        503,
        "1",
        {
            "result": None,
            "success": False,
            "errors": [{"code": 3040, "message": "the model is still loading; retry shortly"}],
            "messages": [],
        },
    )
    oai = httpx.post(
        f"{loading.url}/v1/chat/completions",
        json={"model": SMOLLM2, "messages": [{"role": "user", "content": "hi"}]},
        headers=AUTH,
    )
    assert (oai.status_code, oai.json()) == (
        503,
        {
            "error": {
                "message": "the model is still loading; retry shortly",
                "type": "server_error",
                "param": None,
                "code": "model_loading",
            }
        },
    )
    assert httpx.get(f"{loading.url}/healthz").status_code == 503


def test_no_node_for_the_model_is_503_with_a_longer_retry_after(empty) -> None:
    """No live node serves the model at all: not the busy fleet's 429 'retry shortly'."""
    wai = httpx.post(
        f"{empty.url}/client/v4/accounts/acct/ai/run/smollm2", json={"prompt": "hi"}, headers=AUTH
    )
    message = f"no node serves {SMOLLM2} now"
    assert (wai.status_code, wai.headers["retry-after"], wai.json()["errors"]) == (
        503,
        "10",
        [{"code": 3040, "message": message}],
    )
    oai = httpx.post(
        f"{empty.url}/v1/completions", json={"model": "smollm2", "prompt": "hi"}, headers=AUTH
    )
    assert (oai.status_code, oai.headers["retry-after"], oai.json()) == (
        503,
        "10",
        {
            "error": {
                "message": message,
                "type": "server_error",
                "param": None,
                "code": "model_not_served",
            }
        },
    )


def test_every_response_carries_its_own_request_id(empty) -> None:
    ids = {
        httpx.get(f"{empty.url}/v1/models", headers=AUTH).headers["x-request-id"] for _ in range(3)
    }
    ids.add(httpx.get(f"{empty.url}/nowhere").headers["x-request-id"])
    assert len(ids) == 4
    assert all(len(i) == 32 for i in ids)


def test_openapi_json_is_served(empty) -> None:
    from gateway.openapi import build_openapi

    served, every = httpx.get(f"{empty.url}/openapi.json").json(), build_openapi()
    # the routes mounted: no ledger, limit store or admin token, so no usage, admin, dashboard
    assert served == every | {"paths": {p: every["paths"][p] for p in served["paths"]}}
    assert set(every["paths"]) - set(served["paths"]) == {
        "/client/v4/accounts/{account_id}/ai/usage",
        "/admin/v1/accounts/{account_id}/limits",
        "/admin/v1/dashboard",
        "/dashboard",
        "/dashboard/app.js",
        "/dashboard/style.css",
        "/dashboard/icon.svg",
    }


def test_the_gateway_never_imports_torch() -> None:
    code = "import sys, gateway.app, edgeserve.commands.serve; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


def test_admission_refusals_are_429_in_each_dialect_with_the_limiters_headers() -> None:
    from gateway.admission import LimitPolicy, Limits, LocalLimiter

    keys = MemoryKeyStore()
    asyncio.run(keys.add(KEY, "acct"))
    placer = Placer(CapacityView(LocalCapacityRegistry(), max_age_s=1.0), LocalReservations())
    limiter = LocalLimiter(
        LimitPolicy(default=Limits(requests_per_minute=1, tokens_per_minute=1000))
    )
    app = create_app(GatewaySettings(internal_token="t"), keys=keys, placer=placer, limiter=limiter)
    server = ServerThread(app).start()
    try:
        url = f"{server.url}/client/v4/accounts/acct/ai/run/smollm2"
        # Admitted, then no node: 3040 (the request still counts against the minute).
        first = httpx.post(url, json={"prompt": "hi", "max_tokens": 10}, headers=AUTH)
        assert (first.status_code, first.json()["errors"][0]["code"]) == (503, 3040)
        second = httpx.post(url, json={"prompt": "hi", "max_tokens": 10}, headers=AUTH)
        assert second.status_code == 429
        assert second.json()["errors"] == [
            {"code": 3036, "message": "rate limited: too many requests for this account"}
        ]
        assert second.headers["x-ratelimit-limit-requests"] == "1"
        assert second.headers["x-ratelimit-remaining-requests"] == "0"
        assert 1 <= int(second.headers["retry-after"]) <= 60
        oai = httpx.post(
            f"{server.url}/v1/completions", json={"model": "smollm2", "prompt": "hi"}, headers=AUTH
        )
        assert (oai.status_code, oai.json()["error"]["type"], oai.json()["error"]["code"]) == (
            429,
            "rate_limit_error",
            "rate_limit_exceeded",
        )
        # More tokens than a whole minute allows can never be admitted: 413 / 3006.
        huge = httpx.post(url, json={"prompt": "hi", "max_tokens": 5000}, headers=AUTH)
        assert (huge.status_code, huge.json()["errors"][0]["code"]) == (413, 3006)
        assert huge.json()["errors"][0]["message"] == (
            f"request reserves {0 + 8 + 5000} tokens (its prompt, estimated from its length, "
            "plus max_tokens), more than the account's limit of 1000 tokens per minute; "
            "shorten the prompt or lower max_tokens"
        )
        # OpenAI's own answer to a request past a tokens-per-minute limit, not
        # context_length_exceeded (on which clients trim the conversation)
        body = {"model": "smollm2", "prompt": "hi", "max_tokens": 5000}
        huge = httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH)
        assert (huge.status_code, huge.json()["error"]) == (
            429,
            {
                "message": f"request reserves {2 // 3 + 8 + 5000} tokens (its prompt, estimated "
                "from its length, plus max_tokens), more than the account's limit of 1000 tokens "
                "per minute; shorten the prompt or lower max_tokens",
                "type": "tokens",
                "param": None,
                "code": "rate_limit_exceeded",
            },
        )
        assert "retry-after" not in huge.headers  # waiting never makes it fit
    finally:
        server.stop()


def test_the_openai_client_retrieves_a_model_by_id_or_alias(empty) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{empty.url}/v1", api_key=KEY, max_retries=0)
    model = client.models.retrieve(SMOLLM2)  # the id holds slashes
    assert (model.id, model.object, model.owned_by) == (SMOLLM2, "model", "edgeserve")
    assert client.models.retrieve("smollm2").id == SMOLLM2
    with pytest.raises(openai.NotFoundError) as raised:
        client.models.retrieve("no/such-model")
    assert raised.value.body == {
        "message": "no such model: 'no/such-model'",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    scoped = httpx.get(f"{empty.url}/client/v4/accounts/acct/ai/v1/models/smollm2", headers=AUTH)
    assert (scoped.status_code, scoped.json()["id"]) == (200, SMOLLM2)
    assert httpx.get(f"{empty.url}/v1/models/smollm2").status_code == 401


def test_405_names_the_allowed_methods_and_a_trailing_slash_is_not_found(empty) -> None:
    wrong = httpx.get(f"{empty.url}/v1/chat/completions", headers=AUTH)
    assert (wrong.status_code, wrong.headers["allow"], wrong.json()["error"]["code"]) == (
        405,
        "POST",
        "method_not_allowed",
    )
    run = httpx.get(f"{empty.url}/client/v4/accounts/acct/ai/run/smollm2", headers=AUTH)
    assert (run.status_code, run.headers["allow"], run.json()["errors"][0]["code"]) == (
        405,
        "POST",
        7001,
    )
    # No redirect built from the Host header: a not-found in the path's dialect.
    slash = httpx.post(
        f"{empty.url}/v1/chat/completions/", headers=AUTH | {"host": "evil.example"}, json={}
    )
    assert (slash.status_code, "location" in slash.headers) == (404, False)
    assert slash.json()["error"]["code"] == "not_found"
    health = httpx.get(f"{empty.url}/healthz/")
    assert (health.status_code, health.json()["errors"][0]["code"]) == (404, 7003)
    # /v1 itself is the OpenAI API's root: its not-found is an OpenAI error body.
    root = httpx.get(f"{empty.url}/v1")
    assert (root.status_code, root.json()["error"]["code"]) == (404, "not_found")


def test_a_body_past_the_limit_is_413_before_it_is_read_whole() -> None:
    server = gateway(max_body_bytes=1000)
    try:
        body = b'{"prompt": "' + b"a" * 2000 + b'"}'
        wai = httpx.post(f"{server.url}/client/v4/accounts/acct/ai/run/smollm2", content=body,
                         headers=AUTH)  # fmt: skip
        assert (wai.status_code, wai.json()["errors"]) == (
            413,
            [{"code": 3006, "message": "request body is 2014 bytes; the limit is 1000"}],
        )

        def chunks():  # no Content-Length: refused once the streamed bytes pass the limit
            yield b'{"model": "smollm2", "prompt": "'
            for _ in range(20):
                yield b"a" * 100
            yield b'"}'

        oai = httpx.post(f"{server.url}/v1/completions", content=chunks(), headers=AUTH)
        assert (oai.status_code, oai.json()) == (
            413,
            {
                "error": {
                    "message": "request body is over the limit of 1000 bytes",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "request_too_large",
                }
            },
        )
    finally:
        server.stop()


def test_a_max_tokens_past_the_context_window_is_refused_as_too_large(empty) -> None:
    """Before admission, so the answer names the context, not the account's token limit."""
    message = (
        "max_tokens (1000000000) leaves no room for a prompt in the context window of 8192 tokens"
    )
    wai = httpx.post(f"{empty.url}{RUN_SMOL}", json={"prompt": "hi", "max_tokens": 10**9},
                     headers=AUTH)  # fmt: skip
    assert (wai.status_code, wai.json()["errors"]) == (413, [{"code": 3006, "message": message}])
    oai = httpx.post(
        f"{empty.url}{CHAT}", json={"model": "smollm2", "messages": HI, "max_tokens": 8192},
        headers=AUTH,
    )  # fmt: skip
    assert (oai.status_code, oai.json()["error"]["code"]) == (400, "context_length_exceeded")
    assert oai.json()["error"]["message"].startswith("max_tokens (8192) leaves no room")


def test_a_compressed_body_is_415_in_each_dialect(empty) -> None:
    import gzip

    body = gzip.compress(b'{"model": "smollm2", "prompt": "hi"}')
    headers = AUTH | {"content-encoding": "gzip", "content-type": "application/json"}
    message = "Content-Encoding 'gzip' is not supported: send the JSON body uncompressed"
    wai = httpx.post(f"{empty.url}{RUN_SMOL}", content=body, headers=headers)
    assert (wai.status_code, wai.json()["errors"]) == (415, [{"code": 5004, "message": message}])
    oai = httpx.post(f"{empty.url}/v1/completions", content=body, headers=headers)
    assert (oai.status_code, oai.json()["error"]) == (
        415,
        {"message": message, "type": "invalid_request_error", "param": None,
         "code": "unsupported_media_type"},
    )  # fmt: skip


CHAT = "/v1/chat/completions"
RUN_SMOL = "/client/v4/accounts/acct/ai/run/smollm2"
HI = [{"role": "user", "content": "hi"}]
NOT_SERVED = (503, "no node serves @cf/huggingface/smollm2-135m-instruct now")


@pytest.mark.parametrize(
    ("path", "body", "expected"),
    [
        # JSON's own types, never coerced
        (CHAT, {"messages": HI, "stream": "yes"},
         (400, "invalid request: stream: Input should be a valid boolean", "stream")),
        (CHAT, {"messages": HI, "max_tokens": 4.0},
         (400, "invalid request: max_tokens: Input should be a valid integer", "max_tokens")),
        (CHAT, {"messages": HI, "max_tokens": True},
         (400, "invalid request: max_tokens: Input should be a valid integer", "max_tokens")),
        (RUN_SMOL, {"prompt": "hi", "temperature": "0.5"},
         (400, "invalid request: temperature: Input should be a valid number", 5004)),
        (RUN_SMOL, {"prompt": "hi", "max_tokens": "4"},
         (400, "invalid request: max_tokens: Input should be a valid integer", 5004)),
        # what OpenAI documents as nullable takes null as its default (validation passes:
        # no node serves the model here, so the answer is the 503)
        (CHAT, {"messages": HI, "stream": None, "stream_options": None}, NOT_SERVED),
        ("/v1/completions", {"prompt": "hi", "echo": None}, NOT_SERVED),
        (CHAT, {"messages": HI, "stream": True, "stream_options": {"include_usage": None}},
         NOT_SERVED),
        (CHAT, {"messages": [*HI, {"role": "assistant", "content": None}, *HI]}, NOT_SERVED),
        (CHAT, {"messages": [{"role": "user", "content": None}]},
         (400, "invalid request: messages.0: a user message needs 'content'",
          "messages.0")),
        # options these models cannot honour are refused, never dropped
        (CHAT, {"messages": HI, "logit_bias": {"7042": -100}},
         (400, "'logit_bias' is not supported", "logit_bias")),
        (CHAT, {"messages": HI, "logit_bias": {}}, NOT_SERVED),
        (CHAT, {"messages": HI, "functions": [{"name": "f"}]},
         (400, "'functions' is not supported: use 'tools'", "functions")),
        (CHAT, {"messages": HI, "function_call": "auto"},
         (400, "'function_call' is not supported: use 'tool_choice'", "function_call")),
        (RUN_SMOL, {"prompt": "hi", "lora": "my-adapter"},
         (400, "'lora' is not supported: no adapters are served", 5004)),
        (RUN_SMOL, {"prompt": "hi", "tools": [{"type": "function"}]},
         (400, "invalid request: tools.0: a tool needs 'function' (or 'name')",
          5004)),
        (RUN_SMOL, {"prompt": "hi", "tools": [{"name": "f"}]},
         (400, "'tools' needs 'messages' or 'input'", 5004)),
        (RUN_SMOL, {"prompt": "hi", "response_format": {"type": "json_schema"}},
         (400, "invalid request: response_format: type 'json_schema' needs "
          "'json_schema'", 5004)),
        (RUN_SMOL, {"prompt": "hi", "response_format": {"type": "json_object"}}, NOT_SERVED),
        (RUN_SMOL, {"prompt": "hi", "unknown_field": 1}, NOT_SERVED),  # unknown: ignored
        # a completion's logprobs is a count: 0 still asks for the sampled tokens' own
        ("/v1/completions", {"prompt": "hi", "logprobs": 0}, NOT_SERVED),
        ("/v1/completions", {"prompt": "hi", "logprobs": 6},
         (400, "'logprobs' is an integer from 0 to 5", "logprobs")),
        ("/v1/completions", {"prompt": "hi", "logprobs": None}, NOT_SERVED),
        (CHAT, {"messages": HI, "logprobs": False, "modalities": ["text"]}, NOT_SERVED),
        (CHAT, {"messages": HI, "top_logprobs": 2},
         (400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")),
        (CHAT, {"messages": HI, "top_logprobs": 21},
         (400, "invalid request: top_logprobs: Input should be less than or equal to 20",
          "top_logprobs")),
        (CHAT, {"messages": HI, "n": 17}, (400, "'n' is at most 16", "n")),
        (CHAT, {"messages": HI, "tool_choice": "required"},
         (400, "'tool_choice' needs 'tools'", "tool_choice")),
        (CHAT, {"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}}},
         (400, "tool_choice names no defined function: {'type': 'function', 'function': "
          "{'name': 'g'}}", "tool_choice")),
        (CHAT, {"messages": HI, "response_format": {"type": "xml"}},
         (400, "invalid request: response_format.type: Input should be 'text', 'json_object' "
          "or 'json_schema'", "response_format.type")),
        (CHAT, {"messages": [*HI, {"role": "tool", "content": "18C"}]}, NOT_SERVED),
        (CHAT, {"messages": [*HI, {"role": "user", "content": "x", "tool_calls": []}]},
         NOT_SERVED),
        (CHAT, {"messages": [*HI, {"role": "user", "content": "x", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
         (400, "invalid request: messages.1: only an assistant message carries "
          "'tool_calls'", "messages.1")),
        ("/v1/completions", {"prompt": ""}, (400, "the prompt is empty", "prompt")),
        ("/v1/completions", {"prompt": [""]}, (400, "the prompt is empty", "prompt")),
        # a union's error names the field, not the member type pydantic tried (`stop.str`)
        (CHAT, {"messages": HI, "stop": 5},
         (400, "invalid request: stop: Input should be a valid string; stop: Input should be "
          "a valid list", "stop")),
    ],
)  # fmt: skip
def test_request_fields_are_taken_as_the_apis_define_them(empty, path, body, expected) -> None:
    if path != RUN_SMOL:
        body = {"model": "smollm2", **body}
    response = httpx.post(empty.url + path, json=body, headers=AUTH)
    status, message, *where = expected
    assert response.status_code == status
    if path == RUN_SMOL:
        code = where[0] if where else 3040
        assert response.json()["errors"] == [{"code": code, "message": message}]
    else:
        error = response.json()["error"]
        assert error["message"] == message
        if where:
            assert error["param"] == where[0]


def test_nan_and_infinity_are_not_json(empty) -> None:
    for constant in ("NaN", "Infinity", "-Infinity"):
        body = b'{"prompt": "hi", "temperature": ' + constant.encode() + b"}"
        response = httpx.post(empty.url + RUN_SMOL, content=body, headers=AUTH)
        assert (response.status_code, response.json()["errors"]) == (
            400,
            [{"code": 5004, "message": f"malformed JSON body: {constant} is not a JSON number"}],
        )


def test_a_node_that_cannot_be_reached_is_a_502_the_client_may_retry_at_once(caplog) -> None:
    """Its capacity record is still live (it died within its TTL), and no other node serves
    the model: nothing reached the client, so the 502 carries a Retry-After. The client is
    not told which node, nor its address (they had been in the message): the log is."""
    import time
    from dataclasses import replace

    from scheduler.capacity import CapacityRecord
    from tests.conftest import free_port

    registry = LocalCapacityRegistry()
    dead = f"http://127.0.0.1:{free_port()}"
    record = CapacityRecord(
        node_id="gone", address=dead, role="mixed", models=("smollm2",), num_pages=64,
        num_free_pages=64, page_size=16, kv_dtype="fp32", num_running=0, num_waiting=0,
        load=0.0, published_at=time.time(), ttl_s=60.0, activations="fp32",
    )  # fmt: skip
    asyncio.run(registry.publish(record))
    keys = MemoryKeyStore()
    asyncio.run(keys.add(KEY, "acct"))
    placer = Placer(CapacityView(registry, max_age_s=1.0), LocalReservations())
    server = ServerThread(
        create_app(GatewaySettings(internal_token="t"), keys=keys, placer=placer)
    ).start()
    try:
        unreachable = (
            502,
            "1",
            [
                {
                    "code": 3043,
                    "message": "the node chosen for this request could not be reached; "
                    "retry shortly",
                }
            ],
        )
        wai = httpx.post(f"{server.url}{RUN_SMOL}", json={"prompt": "hi"}, headers=AUTH)
        assert (wai.status_code, wai.headers["retry-after"], wai.json()["errors"]) == unreachable
        request_id = wai.headers["x-request-id"]
        assert [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()] == [
            f"request {request_id}: node gone unreachable: ConnectError('All connection "
            "attempts failed'), before the first token"
        ]
        # Marked down: the next request is not sent there while its record stands.
        wai = httpx.post(f"{server.url}{RUN_SMOL}", json={"prompt": "hi"}, headers=AUTH)
        assert (wai.status_code, wai.json()["errors"][0]["message"]) == (
            503,
            f"no node serves {SMOLLM2} now",
        )
        # A new record from it (alive again, as far as the fleet knows): tried again.
        asyncio.run(registry.publish(replace(record, published_at=time.time())))
        time.sleep(1.0)  # the gateway's view refreshes each second
        wai = httpx.post(f"{server.url}{RUN_SMOL}", json={"prompt": "hi"}, headers=AUTH)
        assert (wai.status_code, wai.headers["retry-after"], wai.json()["errors"]) == unreachable
    finally:
        server.stop()


def test_a_frozen_node_fails_its_request_in_seconds_not_at_the_read_timeout(caplog) -> None:
    """A frozen (stopped, hung) node's kernel still accepts connections, so a request sent
    there had waited out the read timeout (300 s). After node_silence_s with nothing from
    the node, the gateway probes its health; no answer: 502 at once, the node marked down."""
    import socket
    import time

    from scheduler.capacity import CapacityRecord

    registry = LocalCapacityRegistry()
    with socket.create_server(("127.0.0.1", 0), backlog=8) as frozen:  # never accepted
        address = f"http://127.0.0.1:{frozen.getsockname()[1]}"
        record = CapacityRecord(
            node_id="frozen", address=address, role="mixed", models=("smollm2",),
            num_pages=64, num_free_pages=64, page_size=16, kv_dtype="fp32", num_running=0,
            num_waiting=0, load=0.0, published_at=time.time(), ttl_s=60.0, activations="fp32",
        )  # fmt: skip
        asyncio.run(registry.publish(record))
        keys = MemoryKeyStore()
        asyncio.run(keys.add(KEY, "acct"))
        placer = Placer(CapacityView(registry, max_age_s=1.0), LocalReservations())
        settings = GatewaySettings(internal_token="t", node_silence_s=0.3, node_probe_timeout_s=0.3)
        server = ServerThread(create_app(settings, keys=keys, placer=placer)).start()
        try:
            started = time.monotonic()
            wai = httpx.post(f"{server.url}{RUN_SMOL}", json={"prompt": "hi"}, headers=AUTH)
            assert time.monotonic() - started < 5.0
            assert (wai.status_code, wai.headers["retry-after"], wai.json()["errors"]) == (
                502,
                "1",
                [{"code": 3043, "message": "the node serving this request failed; retry shortly"}],
            )
            request_id = wai.headers["x-request-id"]
            assert [r.getMessage() for r in caplog.records if "stopped" in r.getMessage()] == [
                f"request {request_id}: node frozen stopped answering: nothing for 0.3s, no "
                "answer to a probe, before the first token"
            ]
            again = httpx.post(f"{server.url}{RUN_SMOL}", json={"prompt": "hi"}, headers=AUTH)
            assert (again.status_code, again.json()["errors"][0]["message"]) == (
                503,
                f"no node serves {SMOLLM2} now",
            )
        finally:
            server.stop()


def test_a_client_that_leaves_while_queued_gives_its_slot_back_at_once() -> None:
    """The one node is full, so requests wait in the capacity queue (30 s deadline). The
    account may run one request at a time. A queued client that gives up must leave the
    queue then and there: the next request of the account is admitted (and queues), where
    the first one's slot had stayed taken until its deadline (429 at once)."""
    import time

    from gateway.admission import LimitPolicy, Limits, LocalLimiter
    from scheduler.capacity import CapacityRecord
    from tests.conftest import free_port

    registry = LocalCapacityRegistry()
    full = CapacityRecord(
        node_id="full", address=f"http://127.0.0.1:{free_port()}", role="mixed",
        models=("smollm2",), num_pages=64, num_free_pages=0, page_size=16, kv_dtype="fp32",
        num_running=4, num_waiting=0, load=1.0, published_at=time.time(), ttl_s=120.0,
        activations="fp32",
    )  # fmt: skip
    asyncio.run(registry.publish(full))
    keys = MemoryKeyStore()
    asyncio.run(keys.add(KEY, "acct"))
    # No room to reserve on the node: every request waits in the queue.
    placer = Placer(CapacityView(registry, max_age_s=1.0), LocalReservations(), overcommit=0.001)
    limiter = LocalLimiter(LimitPolicy(default=Limits(max_concurrent=1)))
    app = create_app(
        GatewaySettings(internal_token="t", queue_deadline_s=30.0),
        keys=keys, placer=placer, limiter=limiter,
    )  # fmt: skip
    server = ServerThread(app).start()
    try:
        body = {"prompt": "hi", "max_tokens": 4}
        for _ in range(2):  # each gives up after 1 s in the queue; the second is admitted too
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(server.url + RUN_SMOL, json=body, headers=AUTH, timeout=1.0)
            time.sleep(0.3)  # the gateway sees the disconnect
    finally:
        server.stop()


def test_a_completion_prompt_past_the_character_cap_is_refused_in_a_list_too(empty) -> None:
    long = "a" * 1_000_001
    for prompt, where in ((long, "prompt"), ([long], "prompt.0")):
        oai = httpx.post(f"{empty.url}/v1/completions", json={"model": "smollm2", "prompt": prompt},
                         headers=AUTH, timeout=30)  # fmt: skip
        assert oai.status_code == 400
        assert (
            f"{where}: String should have at most 1000000 characters"
            in (oai.json()["error"]["message"])
        )


def test_the_context_window_shown_and_enforced_is_what_the_largest_live_node_takes() -> None:
    """Models list the catalog's 8192 tokens while the live node serving it says nothing (a
    node from before the field), until it says it takes fewer (its KV pool holds 5824): then /v1/models, the model itself and Workers AI's search show 5824,
    and a max_tokens that leaves no room in it is 413 before admission and before any node
    is contacted (the node's address answers nothing). A node from before the field (0)
    leaves the catalog's window."""
    import time
    from dataclasses import replace

    from scheduler.capacity import CapacityRecord
    from tests.conftest import free_port

    registry = LocalCapacityRegistry()
    keys = MemoryKeyStore()
    asyncio.run(keys.add(KEY, "acct"))
    placer = Placer(CapacityView(registry, max_age_s=0.0), LocalReservations())
    server = ServerThread(
        create_app(GatewaySettings(internal_token="t"), keys=keys, placer=placer)
    ).start()

    def windows() -> tuple[int, int, str]:
        listed = httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"]
        one = httpx.get(f"{server.url}/v1/models/smollm2", headers=AUTH).json()
        found = httpx.get(
            f"{server.url}/client/v4/accounts/acct/ai/models/search", headers=AUTH
        ).json()["result"]
        (prop,) = [p for p in found[0]["properties"] if p["property_id"] == "context_window"]
        assert listed[0]["id"] == one["id"] == SMOLLM2
        return listed[0]["context_window"], one["context_window"], prop["value"]

    try:
        record = CapacityRecord(
            node_id="small", address=f"http://127.0.0.1:{free_port()}", role="mixed",
            models=("smollm2",), num_pages=364, num_free_pages=364, page_size=16,
            kv_dtype="fp32", num_running=0, num_waiting=0, load=0.0, published_at=time.time(),
            ttl_s=60.0, activations="fp32", max_request_tokens=0,
        )  # fmt: skip
        asyncio.run(registry.publish(record))
        assert windows() == (8192, 8192, "8192")
        asyncio.run(registry.publish(replace(record, max_request_tokens=5824)))
        assert windows() == (5824, 5824, "5824")
        wai = httpx.post(f"{server.url}{RUN_SMOL}", json={"prompt": "hi", "max_tokens": 6000},
                         headers=AUTH)  # fmt: skip
        assert (wai.status_code, wai.json()["errors"]) == (413, [{"code": 3006, "message": (
            "max_tokens (6000) leaves no room for a prompt in the context window of 5824 tokens"
        )}])  # fmt: skip
        asyncio.run(registry.publish(replace(record, max_request_tokens=0)))
        assert windows() == (8192, 8192, "8192")
    finally:
        server.stop()


def asgi_scope(path: str, headers: dict[str, str]) -> dict:
    """An HTTP request's ASGI scope, as uvicorn hands it to the app."""
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8080),
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()], "state": {},
    }  # fmt: skip


async def call_app(app, scope: dict, messages: list[dict]) -> tuple[int, bytes]:  # type: ignore[no-untyped-def]
    """The app's answer to `messages` (then a disconnect), called as uvicorn calls it: a
    server on loopback cannot send half a body and leave at a point of the test's choosing."""
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def test_a_client_that_leaves_mid_body_is_a_quiet_499(caplog) -> None:
    """It was logged at ERROR as an unhandled error and answered as a node failure (502)."""

    async def main() -> tuple[int, bytes]:
        keys = MemoryKeyStore()
        await keys.add(KEY, "acct")
        placer = Placer(CapacityView(LocalCapacityRegistry(), max_age_s=1.0), LocalReservations())
        app = create_app(GatewaySettings(internal_token="t"), keys=keys, placer=placer,
                         is_ready=lambda: True)  # fmt: skip
        headers = AUTH | {"content-type": "application/json", "content-length": "1000"}
        half = [{"type": "http.request", "body": b'{"model": ', "more_body": True}]
        return await call_app(app, asgi_scope(CHAT, headers), half)

    with caplog.at_level(logging.WARNING):
        status, body = asyncio.run(main())
    assert (status, json.loads(body)) == (
        499,
        {
            "error": {
                "message": "the client closed the connection before its request body arrived",
                "type": "invalid_request_error",
                "param": None,
                "code": "client_closed_request",
            }
        },
    )
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


class FaultyKeyStore(MemoryKeyStore):
    """A key store with a bug of its own: what the gateway does with a fault that is no
    GatewayError (the only such faults left are bugs, which a test cannot reach otherwise)."""

    async def lookup(self, key: str) -> str | None:
        raise RuntimeError("a bug")


def test_a_fault_of_the_gateways_own_is_a_500_in_each_dialect_and_logged(caplog) -> None:
    """It was a 502 upstream_error, which alerts read as a node failure."""
    placer = Placer(CapacityView(LocalCapacityRegistry(), max_age_s=1.0), LocalReservations())
    app = create_app(GatewaySettings(internal_token="t"), keys=FaultyKeyStore(), placer=placer,
                     is_ready=lambda: True)  # fmt: skip
    server = ServerThread(app).start()
    try:
        with caplog.at_level(logging.ERROR):
            wai = httpx.post(f"{server.url}{RUN_SMOL}", json={"prompt": "hi"}, headers=AUTH)
            oai = httpx.post(f"{server.url}{CHAT}", json={"model": "smollm2", "messages": HI},
                             headers=AUTH)  # fmt: skip
    finally:
        server.stop()
    assert (wai.status_code, wai.json()["errors"]) == (
        500,
        [{"code": 3043, "message": "internal error"}],
    )
    assert (oai.status_code, oai.json()["error"]) == (
        500,
        {
            "message": "internal error",
            "type": "server_error",
            "param": None,
            "code": "internal_error",
        },
    )
    assert sum("unhandled error on" in r.getMessage() for r in caplog.records) == 2


@pytest.mark.parametrize(
    ("error", "is_unavailable"),
    [
        ("ConnectionError", True),
        ("TimeoutError", True),
        ("ReadOnlyError", True),  # a replica after a failover
        ("OutOfMemoryError", True),
        ("BusyLoadingError", True),
        ("MasterDownError", True),
        ("ResponseError:MISCONF Redis is configured to save RDB snapshots", True),
        ("ResponseError:NOREPLICAS Not enough good replicas to write", True),
        ("ResponseError:BUSY Redis is busy running a script", True),
        ("ResponseError:WRONGTYPE Operation against a key holding the wrong kind", False),
        ("ResponseError:ERR unknown command", False),
        ("DataError", False),
    ],
)
def test_redis_errors_that_mean_retry_shortly_are_told_from_our_faults(
    error: str, is_unavailable: bool
) -> None:
    import redis.exceptions

    from gateway.app import is_store_unavailable

    name, _, message = error.partition(":")
    assert is_store_unavailable(getattr(redis.exceptions, name)(message)) is is_unavailable
