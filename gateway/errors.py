"""The gateway's errors and the one table that turns them into responses in either dialect.

    GatewayError
    ├── AuthenticationError     401  no key, or a key we do not know
    ├── PermissionDeniedError   403  the key's account is not the account in the path
    ├── NotFoundError           404  no such route
    ├── MethodNotAllowedError   405
    ├── BadRequestError         400  malformed JSON, wrong types, bad values
    │   └── UnsupportedError    400  an option we do not implement (n > 1, tools, logprobs)
    ├── ModelNotFoundError      400 (Workers AI) / 404 (OpenAI)  no such model
    ├── ContextWindowError      413 (Workers AI) / 400 (OpenAI)  prompt + max_tokens past the
    │                                context window (common.window; the node's request_too_large)
    ├── TokenLimitError         413 (Workers AI) / 429 (OpenAI)  the request alone reserves more
    │                                than its account's tokens per minute: never admissible
    ├── PayloadTooLargeError    413  a body past the size limit
    ├── UnsupportedMediaError   415  a compressed body (Content-Encoding other than identity)
    ├── ConflictError           409  a request id already holds an admission (ids are ours: a bug)
    ├── RateLimitedError        429  admission said no (carries Retry-After and limit headers)
    ├── NoCapacityError         429  every node serving the model is full now (Retry-After)
    ├── NotServedError          503  no live node serves the model (Retry-After: nodes come back)
    ├── NotReadyError           503  the model is still loading
    ├── UnavailableError        503  the rate-limit store is unreachable and admission fails closed
    ├── UpstreamError           502  a node failed
    ├── InternalError           500  a fault of the gateway's own (logged with its traceback)
    └── ClientClosedError       499  the client left before a whole (non-streamed) answer:
                                     written to nobody, it names the request in the access log

Every answer that carries `retry_after_s` gets `Retry-After` (whole seconds, 1..60:
official clients ignore larger values) and `retry-after-ms` (what the openai client
reads first).

Workers AI bodies are the envelope `{"result": null, "success": false,
"errors": [{"code", "message"}], "messages": []}`; OpenAI bodies are
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Literal

Dialect = Literal["workers_ai", "openai"]


class GatewayError(Exception):
    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        retry_after_s: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s
        self.headers = headers or {}


class AuthenticationError(GatewayError):
    pass


class PermissionDeniedError(GatewayError):
    pass


class NotFoundError(GatewayError):
    pass


class MethodNotAllowedError(GatewayError):
    pass


class BadRequestError(GatewayError):
    pass


class UnsupportedError(BadRequestError):
    pass


class GrammarError(BadRequestError):
    """A response format or tools no grammar can be built from (the node said why)."""


class ModelNotFoundError(GatewayError):
    pass


class ContextWindowError(GatewayError):
    pass


class TokenLimitError(GatewayError):
    pass


class PayloadTooLargeError(GatewayError):
    pass


class UnsupportedMediaError(GatewayError):
    pass


class ConflictError(GatewayError):
    pass


class RateLimitedError(GatewayError):
    pass


class NoCapacityError(GatewayError):
    pass


class NotServedError(GatewayError):
    pass


class NotReadyError(GatewayError):
    pass


class UnavailableError(GatewayError):
    pass


class UpstreamError(GatewayError):
    """A node failed. The client reads `message`, which names no node; `detail` (which node,
    its address, what it said) goes to the log and the trace only: node ids, internal
    addresses and a node's exception text are the fleet's own business."""

    def __init__(self, message: str, *, detail: str | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.detail = detail or message


class ClientClosedError(GatewayError):
    pass


class InternalError(GatewayError):
    pass


@dataclass(frozen=True)
class ErrorShape:
    workers_ai_status: int
    workers_ai_code: int
    openai_status: int
    openai_type: str
    openai_code: str | None


# Most specific class first: lookup walks the exception's MRO.
ERROR_TABLE: dict[type[GatewayError], ErrorShape] = {
    AuthenticationError: ErrorShape(401, 10000, 401, "invalid_request_error", "invalid_api_key"),
    PermissionDeniedError: ErrorShape(403, 10000, 403, "permission_error", "forbidden"),
    NotFoundError: ErrorShape(404, 7003, 404, "invalid_request_error", "not_found"),
    MethodNotAllowedError: ErrorShape(
        405, 7001, 405, "invalid_request_error", "method_not_allowed"
    ),
    UnsupportedError: ErrorShape(400, 5004, 400, "invalid_request_error", "unsupported_parameter"),
    GrammarError: ErrorShape(400, 5004, 400, "invalid_request_error", None),
    BadRequestError: ErrorShape(400, 5004, 400, "invalid_request_error", None),
    ModelNotFoundError: ErrorShape(400, 5007, 404, "invalid_request_error", "model_not_found"),
    ContextWindowError: ErrorShape(
        413, 3006, 400, "invalid_request_error", "context_length_exceeded"
    ),
    # OpenAI's own answer to a request past a tokens-per-minute limit (type "tokens"); not
    # context_length_exceeded, on which clients trim the conversation.
    TokenLimitError: ErrorShape(413, 3006, 429, "tokens", "rate_limit_exceeded"),
    PayloadTooLargeError: ErrorShape(413, 3006, 413, "invalid_request_error", "request_too_large"),
    UnsupportedMediaError: ErrorShape(
        415, 5004, 415, "invalid_request_error", "unsupported_media_type"
    ),
    ConflictError: ErrorShape(409, 5004, 409, "invalid_request_error", "duplicate_request_id"),
    RateLimitedError: ErrorShape(429, 3036, 429, "rate_limit_error", "rate_limit_exceeded"),
    NoCapacityError: ErrorShape(429, 3040, 429, "server_error", "no_capacity"),
    NotServedError: ErrorShape(503, 3040, 503, "server_error", "model_not_served"),
    NotReadyError: ErrorShape(503, 3040, 503, "server_error", "model_loading"),
    UnavailableError: ErrorShape(503, 7010, 503, "server_error", "service_unavailable"),
    UpstreamError: ErrorShape(502, 3043, 502, "server_error", "upstream_error"),
    InternalError: ErrorShape(500, 3043, 500, "server_error", "internal_error"),
    ClientClosedError: ErrorShape(499, 5004, 499, "invalid_request_error", "client_closed_request"),
}


def shape_of(error: GatewayError) -> ErrorShape:
    for cls in type(error).__mro__:
        if cls in ERROR_TABLE:
            return ERROR_TABLE[cls]
    raise TypeError(f"{type(error).__name__} has no row in ERROR_TABLE")


def error_body(error: GatewayError, dialect: Dialect) -> dict[str, Any]:
    shape = shape_of(error)
    if dialect == "workers_ai":
        return {
            "result": None,
            "success": False,
            "errors": [{"code": shape.workers_ai_code, "message": error.message}],
            "messages": [],
        }
    return {
        "error": {
            "message": error.message,
            "type": shape.openai_type,
            "param": error.param,
            "code": shape.openai_code,
        }
    }


def error_status(error: GatewayError, dialect: Dialect) -> int:
    shape = shape_of(error)
    return shape.workers_ai_status if dialect == "workers_ai" else shape.openai_status


MAX_RETRY_AFTER_S = 60  # the official clients ignore a Retry-After above this


def error_headers(error: GatewayError) -> dict[str, str]:
    headers = dict(error.headers)
    if error.retry_after_s is not None:
        retry_ms = min(max(1, math.ceil(error.retry_after_s * 1000)), MAX_RETRY_AFTER_S * 1000)
        # Retry-After is whole seconds; round up so a client never retries early.
        headers["retry-after"] = str(max(1, math.ceil(retry_ms / 1000)))
        headers["retry-after-ms"] = str(retry_ms)
    return headers


def error_json(error: GatewayError, dialect: Dialect) -> bytes:
    return json.dumps(error_body(error, dialect), separators=(",", ":")).encode()
