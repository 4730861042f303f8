"""What every public handler shares: a pydantic error as one 400 naming its fields, and a
GatewayError raised by a handler as a response in the handler's dialect."""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import BaseModel, Field, ValidationError, field_validator
from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import BadRequestError, RateLimitedError
from gateway.http import endpoint, error_response, validation_error


class Message(BaseModel):
    role: str
    content: str | list[dict[str, str]]


class Body(BaseModel):
    max_tokens: int = Field(default=16, ge=1)
    stop: str | list[str] | None = None
    messages: list[Message] = []
    seed: int | None = None

    @field_validator("seed")
    @classmethod
    def _seed(cls, seed: int | None) -> int | None:
        if seed is not None and seed < 0:
            raise ValueError("seed must be >= 0")
        return seed


@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        ({"max_tokens": 0}, "max_tokens: Input should be greater than or equal to 1",
         "max_tokens"),
        # the union's member types are not fields: both tries name `stop`
        ({"stop": 5}, "stop: Input should be a valid string; stop: Input should be a valid list",
         "stop"),
        ({"messages": [{"role": "user", "content": 7}]},
         "messages.0.content: Input should be a valid string; messages.0.content: Input should "
         "be a valid list", "messages.0.content"),
        ({"seed": -1}, "seed: seed must be >= 0", "seed"),  # a validator's text, as it is
        ({"max_tokens": "x", "seed": -2},
         "max_tokens: Input should be a valid integer, unable to parse string as an integer; "
         "seed: seed must be >= 0", "max_tokens"),  # every problem; the first one's param
    ],
)  # fmt: skip
def test_a_validation_error_names_every_field_and_the_first_as_param(
    body: dict[str, object], message: str, param: str
) -> None:
    with pytest.raises(ValidationError) as raised:
        Body.model_validate(body)
    error = validation_error(raised.value)
    assert isinstance(error, BadRequestError)
    assert (error.message, error.param) == ("invalid request: " + message, param)


def _request() -> Request:
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    return Request(scope)


def test_a_handlers_gateway_error_is_answered_in_its_dialect() -> None:
    async def refused(request: Request) -> Response:
        raise RateLimitedError(
            "rate limited", retry_after_s=2.5, headers={"x-ratelimit-limit-requests": "3"}
        )

    async def fine(request: Request) -> Response:
        return Response("ok")

    openai = asyncio.run(endpoint("openai")(refused)(_request()))
    assert openai.status_code == 429
    assert json.loads(openai.body) == {
        "error": {"message": "rate limited", "type": "rate_limit_error", "param": None,
                  "code": "rate_limit_exceeded"},
    }  # fmt: skip
    assert (openai.headers["retry-after"], openai.headers["retry-after-ms"]) == ("3", "2500")
    assert openai.headers["x-ratelimit-limit-requests"] == "3"
    assert openai.headers["content-type"] == "application/json"
    workers_ai = asyncio.run(endpoint("workers_ai")(refused)(_request()))
    assert (workers_ai.status_code, json.loads(workers_ai.body)["errors"]) == (
        429, [{"code": 3036, "message": "rate limited"}],
    )  # fmt: skip
    assert asyncio.run(endpoint("openai")(fine)(_request())).body == b"ok"


def test_an_error_response_is_compact_json() -> None:
    response = error_response(BadRequestError("bad \u2028 input", param="x"), "openai")
    assert response.body == (
        b'{"error":{"message":"bad \\u2028 input","type":"invalid_request_error","param":"x",'
        b'"code":null}}'
    )
