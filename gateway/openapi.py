"""`/openapi.json`, generated (never written by hand) from the pydantic models of the bodies
the gateway takes (gateway/schemas.py) and answers (gateway/response_bodies.py), and from
the one error table (gateway/errors.py): each operation lists the errors its handler can
raise, and the table gives their statuses and body shape in the route's dialect.

`build_openapi(routes)` documents the routes mounted (the usage, limits and dashboard
routes are mounted only where their stores are wired in).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.routing import BaseRoute, Route

from gateway.admission.admin import LimitsUpdate
from gateway.errors import (
    AuthenticationError,
    BadRequestError,
    ConflictError,
    ContextWindowError,
    Dialect,
    GatewayError,
    InternalError,
    ModelNotFoundError,
    NoCapacityError,
    NotFoundError,
    NotReadyError,
    NotServedError,
    PayloadTooLargeError,
    PermissionDeniedError,
    RateLimitedError,
    TokenLimitError,
    UnavailableError,
    UnsupportedMediaError,
    UpstreamError,
    error_status,
)
from gateway.response_bodies import RESPONSE_MODELS
from gateway.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingsRequest,
    ResponsesRequest,
    WorkersAIBatchRequest,
    WorkersAIEmbeddingRequest,
    WorkersAITextRequest,
)

ACCOUNT_AI = "/client/v4/accounts/{account_id}/ai"

_ACCOUNT = {"name": "account_id", "in": "path", "required": True, "schema": {"type": "string"}}
_MODEL = {"name": "model_name", "in": "path", "required": True, "schema": {"type": "string"}}
_MODEL_ID = {"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}
_LIMITS_MODEL = {
    "name": "model",
    "in": "query",
    "required": False,
    "description": "one model's override (a catalog name, an alias or a node model)",
    "schema": {"type": "string"},
}

# What a client reads for each error (the error tree: gateway/errors.py).
_WHY: dict[type[GatewayError], str] = {
    AuthenticationError: "no API key, or an unknown one",
    PermissionDeniedError: "the key's account is not the account in the path",
    BadRequestError: "malformed JSON, wrong types or values, an option not supported",
    ModelNotFoundError: "no such model",
    ContextWindowError: "prompt + max_tokens past the model's context window",
    TokenLimitError: "the request alone is past its account's tokens per minute",
    PayloadTooLargeError: "a body past the size limit",
    UnsupportedMediaError: "a compressed body",
    ConflictError: "a request id already admitted",
    RateLimitedError: "past the account's limits (Retry-After)",
    NoCapacityError: "every node serving the model is full (Retry-After)",
    NotServedError: "no live node serves the model (Retry-After)",
    NotReadyError: "the model is still loading (Retry-After)",
    UnavailableError: "the shared store is unavailable (Retry-After)",
    UpstreamError: "a node failed (Retry-After)",
    InternalError: "a fault of the gateway's own",
    NotFoundError: "no such override",
}

_ANY = (UnavailableError, InternalError)  # a store away, a fault of ours: any API route
_CATALOG = (AuthenticationError, PermissionDeniedError, *_ANY)
_RUN = (
    *_CATALOG,
    BadRequestError,
    ModelNotFoundError,
    ContextWindowError,
    TokenLimitError,
    PayloadTooLargeError,
    UnsupportedMediaError,
    ConflictError,
    RateLimitedError,
    NoCapacityError,
    NotServedError,
    NotReadyError,
    UpstreamError,
)


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _errors(
    dialect: Dialect, errors: Iterable[type[GatewayError]], has_account: bool
) -> dict[str, Any]:
    """The error statuses of an operation in `dialect`, each with its body's schema."""
    why: dict[int, list[str]] = {}
    for cls in errors:
        if cls is PermissionDeniedError and not has_account:
            continue  # no account in the path to differ from the key's
        status = error_status(cls("x"), dialect)
        why.setdefault(status, []).append(_WHY[cls])
    body = _ref("OpenAIError" if dialect == "openai" else "WorkersAIError")
    return {
        str(status): {"description": "; ".join(reasons), "content": _json(body)}
        for status, reasons in sorted(why.items())
    }


def _operation(
    summary: str,
    params: list[dict[str, Any]],
    ok: dict[str, Any],
    errors: dict[str, Any],
    *,
    body: dict[str, Any] | None = None,
    is_public: bool = False,
) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "summary": summary,
        "parameters": params,
        "responses": {"200": ok, **errors},
    }
    if body is not None:
        operation["requestBody"] = {"required": True, "content": _json(body)}
    if is_public:
        operation["security"] = []
    return operation


def _generation_ok(name: str) -> dict[str, Any]:
    return {
        "description": "the answer; a text/event-stream of `data:` events when `stream` is true",
        "content": {**_json(_ref(name)), "text/event-stream": {"schema": {"type": "string"}}},
    }


def _ok(name: str, description: str = "the answer") -> dict[str, Any]:
    return {"description": description, "content": _json(_ref(name))}


def _workers_ai_paths() -> dict[str, dict[str, Any]]:
    account = [_ACCOUNT]
    search_params: list[dict[str, Any]] = [
        _ACCOUNT,
        *(
            {"name": n, "in": "query", "required": False, "schema": {"type": "string"}}
            for n in ("search", "task", "author")
        ),
        {"name": "hide_experimental", "in": "query", "required": False,
         "schema": {"type": "boolean"}},
        {"name": "page", "in": "query", "required": False,
         "schema": {"type": "integer", "minimum": 1, "maximum": 1_000_000, "default": 1}},
        {"name": "per_page", "in": "query", "required": False,
         "schema": {"type": "integer", "minimum": 1, "maximum": 100, "default": 20}},
    ]  # fmt: skip
    usage_params = [
        {
            "name": n,
            "in": "query",
            "required": False,
            "description": d,
            "schema": {"type": "string"},
        }
        for n, d in (
            ("from", "first UTC day, YYYY-MM-DD (30 days before `to`)"),
            ("to", "last UTC day, YYYY-MM-DD (today)"),
            ("group_by", "comma-separated: account, model, day"),
            ("account_id", "another account, or * for all (admin token)"),
        )
    ]
    run_body = {
        "oneOf": [
            _ref("WorkersAITextRequest"),
            _ref("WorkersAIEmbeddingRequest"),
            _ref("WorkersAIBatchRequest"),
        ]
    }
    queue_request = {
        "name": "queueRequest", "in": "query", "required": False,
        "description": "true: queue `requests` as an async batch, or poll `request_id`",
        "schema": {"type": "string", "enum": ["true", "false"]},
    }  # fmt: skip
    return {
        f"{ACCOUNT_AI}/run/{{model_name}}": {
            "post": _operation(
                "Workers AI text generation, text embeddings for an embedding model, or an "
                "async batch (`queueRequest`)",
                [_ACCOUNT, _MODEL, queue_request],
                _generation_ok("WorkersAIRunResponse"),
                _errors("workers_ai", _RUN, True),
                body=run_body,
            )
        },
        f"{ACCOUNT_AI}/models/search": {
            "get": _operation(
                "Workers AI model catalog: the models live nodes serve",
                search_params,
                _ok("WorkersAIModelSearch"),
                _errors("workers_ai", (*_CATALOG, BadRequestError), True),
            )
        },
        f"{ACCOUNT_AI}/usage": {
            "get": _operation(
                "Usage and cost per UTC day: an account's with its key, any with the admin token",
                [*account, *usage_params],
                _ok("UsageResponse"),
                _errors(
                    "workers_ai",
                    (AuthenticationError, PermissionDeniedError, BadRequestError, *_ANY),
                    True,
                ),
            )
        },
    }


def _openai_paths() -> dict[str, dict[str, Any]]:
    paths: dict[str, dict[str, Any]] = {}
    for base, params in (("/v1", []), (f"{ACCOUNT_AI}/v1", [_ACCOUNT])):
        has_account = bool(params)

        errors = _errors("openai", _RUN, has_account)
        for path, summary, request, ok in (
            ("chat/completions", "OpenAI chat completions", "ChatCompletionRequest",
             _generation_ok("ChatCompletion")),
            ("completions", "OpenAI completions (a raw prompt)", "CompletionRequest",
             _generation_ok("Completion")),
            ("embeddings", "OpenAI embeddings", "EmbeddingsRequest", _ok("EmbeddingList")),
            ("responses", "OpenAI Responses (stateless)", "ResponsesRequest",
             _generation_ok("ResponseObject")),
        ):  # fmt: skip
            paths[f"{base}/{path}"] = {
                "post": _operation(summary, params, ok, errors, body=_ref(request))
            }
        paths[f"{base}/models"] = {
            "get": _operation(
                "OpenAI model list: the models live nodes serve",
                params,
                _ok("ModelList"),
                _errors("openai", _CATALOG, has_account),
            )
        }
        paths[f"{base}/models/{{model_id}}"] = {
            "get": _operation(
                "OpenAI model, by its id or an alias",
                [*params, _MODEL_ID],
                _ok("Model"),
                _errors("openai", (*_CATALOG, ModelNotFoundError), has_account),
            )
        }
    return paths


def _admin_paths() -> dict[str, dict[str, Any]]:
    """The limits admin API and the dashboard: the admin token, Workers AI envelopes."""
    account = [_ACCOUNT]
    unauthorized = {"description": "no admin token, or a wrong one", "content": _json(_ref("WorkersAIError"))}  # fmt: skip
    invalid = {"description": "a bad account id, model or body", "content": _json(_ref("WorkersAIError"))}  # fmt: skip
    away = {"description": "the limit store is unreachable", "content": _json(_ref("WorkersAIError"))}  # fmt: skip
    internal = _errors("workers_ai", (InternalError,), False)
    limits = {"400": invalid, "401": unauthorized, **internal, "503": away}
    not_found = {"description": "no such override", "content": _json(_ref("WorkersAIError"))}
    return {
        "/admin/v1/accounts/{account_id}/limits": {
            "get": _operation(
                "An account's limit overrides and the limits that apply to it",
                [*account, _LIMITS_MODEL],
                _ok("LimitsResponse"),
                limits,
            ),
            "put": _operation(
                "Sets the override of the account, or of the account on one model",
                account,
                _ok("LimitsResponse"),
                limits,
                body=_ref("LimitsUpdate"),
            ),
            "delete": _operation(
                "Drops one override",
                [*account, _LIMITS_MODEL],
                _ok("LimitsResponse"),
                dict(sorted({**limits, "404": not_found}.items())),
            ),
        },
        "/admin/v1/dashboard": {
            "get": _operation(
                "The dashboard's numbers: fleet, queue, this gateway's counters, today's usage",
                [],
                _ok("DashboardResponse"),
                {"401": unauthorized, **internal},
            )
        },
    }


def _operational_paths() -> dict[str, dict[str, Any]]:
    internal = _errors("workers_ai", (InternalError,), False)

    def static(summary: str, media_type: str) -> dict[str, Any]:
        ok = {"description": summary, "content": {media_type: {"schema": {"type": "string"}}}}
        return {"get": _operation(summary, [], ok, internal, is_public=True)}

    health_ok = _ok("Health", "ready (`ok`), or serving known keys while the store is away")
    loading = {"description": "the model is still loading", "content": _json(_ref("Health"))}
    return {
        "/openapi.json": {
            "get": _operation(
                "This document",
                [],
                {"description": "OpenAPI 3.1", "content": _json({"type": "object"})},
                internal,
                is_public=True,
            )
        },
        "/healthz": {
            "get": _operation(
                "Readiness",
                [],
                health_ok,
                dict(sorted({**internal, "503": loading}.items())),
                is_public=True,
            )
        },
        "/metrics": static("Prometheus metrics", "text/plain"),
        "/dashboard": static("The dashboard page", "text/html"),
        "/dashboard/app.js": static("The dashboard's script", "text/javascript"),
        "/dashboard/style.css": static("The dashboard's style sheet", "text/css"),
        "/dashboard/icon.svg": static("The dashboard's icon", "image/svg+xml"),
    }


@functools.cache
def _document() -> dict[str, Any]:
    models: tuple[type[BaseModel], ...] = (
        WorkersAITextRequest,
        WorkersAIEmbeddingRequest,
        WorkersAIBatchRequest,
        ChatCompletionRequest,
        CompletionRequest,
        EmbeddingsRequest,
        ResponsesRequest,
        LimitsUpdate,
        *RESPONSE_MODELS,
    )
    _, defs = models_json_schema(
        [(m, "validation") for m in models],
        ref_template="#/components/schemas/{model}",
    )
    return {
        "openapi": "3.1.0",
        "info": {"title": "edgeserve", "version": "1"},
        "components": {
            "schemas": defs["$defs"],
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "an API key; the admin token on /admin routes and usage",
                }
            },
        },
        "security": [{"bearer": []}],
        "paths": {
            **_workers_ai_paths(),
            **_openai_paths(),
            **_admin_paths(),
            **_operational_paths(),
        },
    }


def _template(route: Route) -> str:
    """A route's path as OpenAPI writes it: `{model_name:path}` -> `{model_name}`."""
    return re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path)


def build_openapi(routes: Sequence[BaseRoute] | None = None) -> dict[str, Any]:
    """The document: of every route the gateway can mount, or of those in `routes` (the
    operations of their paths and methods)."""
    document = _document()
    if routes is None:
        return document
    mounted: dict[str, set[str]] = {}
    for route in routes:
        if isinstance(route, Route):
            mounted.setdefault(_template(route), set()).update(
                m.lower() for m in route.methods or ()
            )
    paths = {
        path: {m: op for m, op in operations.items() if m in mounted.get(path, ())}
        for path, operations in document["paths"].items()
    }
    return document | {"paths": {path: ops for path, ops in paths.items() if ops}}
