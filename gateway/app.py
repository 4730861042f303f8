"""The gateway's ASGI app: `create_app(settings, ...)` wires routes, middleware and error mapping.

Stores come in as constructor arguments (Redis-backed in a fleet, in-process
for `edgeserve up`), so the same app runs in both shapes and in tests.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp

from gateway import openai_api, workers_ai
from gateway.admission import Limiter
from gateway.catalog import ModelCatalog
from gateway.dispatch import Dispatcher, UsageSinkLike
from gateway.errors import (
    Dialect,
    GatewayError,
    MethodNotAllowedError,
    NotFoundError,
    UpstreamError,
)
from gateway.http import Gateway, JSONBytes, error_response
from gateway.keys import KeyStore
from gateway.middleware import RequestIdMiddleware
from gateway.openapi import build_openapi
from gateway.settings import GatewaySettings
from scheduler.placement import Placer

log = logging.getLogger(__name__)

ACCOUNT_AI = "/client/v4/accounts/{account_id}/ai"


def dialect_of_path(path: str) -> Dialect:
    return "openai" if path.startswith("/v1/") or "/ai/v1/" in path else "workers_ai"


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    error: GatewayError
    if exc.status_code == 405:
        error = MethodNotAllowedError(f"{request.method} is not allowed on {request.url.path}")
    else:
        error = NotFoundError(f"no route for {request.method} {request.url.path}")
    return error_response(error, dialect_of_path(request.url.path))


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path, exc_info=exc)
    return error_response(UpstreamError("internal error"), dialect_of_path(request.url.path))


def create_app(
    settings: GatewaySettings,
    *,
    keys: KeyStore,
    placer: Placer,
    catalog: ModelCatalog | None = None,
    limiter: Limiter | None = None,
    usage_sink: UsageSinkLike | None = None,
    is_ready: Callable[[], bool] = lambda: True,
    on_startup: Callable[[], Awaitable[object]] | None = None,
    on_shutdown: Callable[[], Awaitable[object]] | None = None,
) -> ASGIApp:
    """The public gateway. `is_ready` gates requests (503 until it says yes: `edgeserve up` loading);
    `on_startup` / `on_shutdown` start and stop what the caller wired in (sinks, clients)."""
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(
            settings.node_read_timeout_s, connect=settings.node_connect_timeout_s
        ),
        limits=httpx.Limits(
            max_connections=settings.max_node_connections,
            max_keepalive_connections=settings.max_node_connections,
        ),
    )
    gateway = Gateway(
        settings=settings,
        catalog=catalog or ModelCatalog(),
        keys=keys,
        dispatcher=Dispatcher(client, placer, settings.internal_token, limiter, usage_sink),
        is_ready=is_ready,
    )

    async def openapi(request: Request) -> Response:
        return JSONBytes(build_openapi())

    async def healthz(request: Request) -> Response:
        ready = gateway.is_ready()
        return JSONBytes(
            {"status": "ok" if ready else "loading"}, status_code=200 if ready else 503
        )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if on_startup is not None:
            await on_startup()
        try:
            yield
        finally:
            await client.aclose()
            if on_shutdown is not None:
                await on_shutdown()

    routes = [
        Route(f"{ACCOUNT_AI}/run/{{model_name:path}}", workers_ai.run_model, methods=["POST"]),
        Route(f"{ACCOUNT_AI}/models/search", workers_ai.search_models, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
    ]
    for base in ("/v1", f"{ACCOUNT_AI}/v1"):
        routes += [
            Route(f"{base}/chat/completions", openai_api.chat_completions, methods=["POST"]),
            Route(f"{base}/completions", openai_api.completions, methods=["POST"]),
            Route(f"{base}/models", openai_api.list_models, methods=["GET"]),
        ]
    app = Starlette(
        routes=routes,
        exception_handlers={HTTPException: _http_exception, Exception: _unexpected},
        lifespan=lifespan,
    )
    app.state.gateway = gateway
    return RequestIdMiddleware(app)
