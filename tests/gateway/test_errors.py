"""The gateway's error tree and the one table that turns an error into status, body and
headers in either dialect."""

from __future__ import annotations

import inspect
import json

import pytest

from gateway import errors
from gateway.errors import (
    ERROR_TABLE,
    BadRequestError,
    ContextWindowError,
    GatewayError,
    RateLimitedError,
    TokenLimitError,
    UnsupportedError,
    UpstreamError,
    error_body,
    error_headers,
    error_json,
    error_status,
    shape_of,
)


def test_every_error_of_the_tree_has_a_row() -> None:
    tree = {
        cls
        for _, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, GatewayError) and cls is not GatewayError
    }
    assert tree == set(ERROR_TABLE)
    with pytest.raises(TypeError, match="GatewayError has no row in ERROR_TABLE"):
        shape_of(GatewayError("no kind"))


def test_the_most_specific_row_wins() -> None:
    class NodeSaidNo(UpstreamError):
        pass

    assert shape_of(UnsupportedError("n > 1")).openai_code == "unsupported_parameter"
    assert shape_of(BadRequestError("bad")).openai_code is None
    assert shape_of(NodeSaidNo("boom")) == ERROR_TABLE[UpstreamError]


@pytest.mark.parametrize(
    ("error", "workers_ai", "openai"),
    [
        (ContextWindowError("too long", param="max_tokens"), 413, 400),
        (TokenLimitError("over the minute"), 413, 429),
        (UpstreamError("a node failed", detail="node-1 at 10.0.0.1 said boom"), 502, 502),
    ],
)
def test_one_error_answers_in_each_dialect(
    error: GatewayError, workers_ai: int, openai: int
) -> None:
    shape = shape_of(error)
    assert (error_status(error, "workers_ai"), error_status(error, "openai")) == (
        workers_ai, openai,
    )  # fmt: skip
    assert error_body(error, "workers_ai") == {
        "result": None,
        "success": False,
        "errors": [{"code": shape.workers_ai_code, "message": error.message}],
        "messages": [],
    }
    assert error_body(error, "openai") == {
        "error": {
            "message": error.message,
            "type": shape.openai_type,
            "param": error.param,
            "code": shape.openai_code,
        }
    }


def test_the_body_names_what_the_client_may_read_and_no_node() -> None:
    error = UpstreamError("a node failed", detail="node-1 at 10.0.0.1 said boom")
    assert error_json(error, "openai") == (
        b'{"error":{"message":"a node failed","type":"server_error","param":null,'
        b'"code":"upstream_error"}}'
    )
    assert error_json(ContextWindowError("too long", param="max_tokens"), "workers_ai") == (
        b'{"result":null,"success":false,"errors":[{"code":3006,"message":"too long"}],'
        b'"messages":[]}'
    )
    assert "10.0.0.1" not in json.dumps(error_body(error, "workers_ai"))
    assert error.detail == "node-1 at 10.0.0.1 said boom"


@pytest.mark.parametrize(
    ("retry_after_s", "retry_after", "retry_after_ms"),
    [(0.0, "1", "1"), (0.2, "1", "200"), (2.5, "3", "2500"), (600.0, "60", "60000")],
)
def test_a_retry_is_whole_seconds_rounded_up_and_at_most_60(
    retry_after_s: float, retry_after: str, retry_after_ms: str
) -> None:
    limits = {"x-ratelimit-limit-requests": "3"}
    error = RateLimitedError("slow down", retry_after_s=retry_after_s, headers=limits)
    assert error_headers(error) == {
        "x-ratelimit-limit-requests": "3",
        "retry-after": retry_after,
        "retry-after-ms": retry_after_ms,
    }
    assert error.headers == limits  # the error's own headers are not changed
    assert error_headers(BadRequestError("bad")) == {}
