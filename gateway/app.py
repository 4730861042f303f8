"""The gateway's ASGI app: `create_app(settings, ...)` wires routes, middleware and error mapping.

Stores come in as constructor arguments (Redis-backed in a fleet, in-process
for `edgeserve up`), so the same app runs in both shapes and in tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp

from billing.http import ADMIN, Principal, usage_endpoint
from billing.ledger import Ledger
from billing.prices import PriceTable
from common.telemetry import Telemetry, TelemetrySettings, setup_telemetry
from gateway import openai_api, responses_api, workers_ai
from gateway.admission import CapacityQueue, Limiter, LimitPolicy, LimitStore
from gateway.admission.admin import AdminToken, LimitsAdmin
from gateway.batch.store import BatchStore, LocalBatchStore
from gateway.batch.worker import BatchWorker, Headroom, InteractiveTraffic, WorkerSettings
from gateway.catalog import ModelCatalog
from gateway.dashboard import Dashboard, FleetGauges, RecentErrors, RecentErrorsMiddleware
from gateway.dispatch import Dispatcher
from gateway.errors import (
    Dialect,
    GatewayError,
    InternalError,
    MethodNotAllowedError,
    NotFoundError,
    UnavailableError,
)
from gateway.http import Gateway, JSONBytes, error_response
from gateway.keys import KeyStore
from gateway.metering import UsageSinkLike
from gateway.middleware import RequestIdMiddleware
from gateway.openapi import build_openapi
from gateway.settings import GatewaySettings
from gateway.tracing import GenAITracer, TracingMiddleware
from scheduler.placement import Placement, Placer
from scheduler.store_watch import is_store_unavailable as is_store_unavailable

log = logging.getLogger(__name__)

ACCOUNT_AI = "/client/v4/accounts/{account_id}/ai"


def dialect_of_path(path: str) -> Dialect:
    openai = (
        path == "/v1" or path.startswith("/v1/") or path.endswith("/ai/v1") or "/ai/v1/" in path
    )
    return "openai" if openai else "workers_ai"


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    error: GatewayError
    if exc.status_code == 405:
        allow = (exc.headers or {}).get("Allow")
        error = MethodNotAllowedError(
            f"{request.method} is not allowed on {request.url.path}",
            headers={"allow": allow} if allow else None,
        )
    else:
        error = NotFoundError(f"no route for {request.method} {request.url.path}")
    return error_response(error, dialect_of_path(request.url.path))


# Seconds a client is told to wait when the fleet's shared store does not answer.
STORE_RETRY_AFTER_S = 2.0
STORE_PING_TIMEOUT_S = 0.5  # how long /healthz waits for the store's PING


async def _store_error(request: Request, exc: Exception) -> Response:
    """Redis (keys, limits, capacity, reservations) could not serve: 503, retry shortly.
    Any other Redis error is a fault of ours, as any other exception is."""
    if not is_store_unavailable(exc):
        return await _unexpected(request, exc)
    log.warning("the shared store could not serve %s: %s", request.url.path, exc)
    error = UnavailableError(
        "the service's shared store is unavailable; retry shortly",
        retry_after_s=STORE_RETRY_AFTER_S,
    )
    return error_response(error, dialect_of_path(request.url.path))


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path, exc_info=exc)
    # Our fault, not a node's: a 500, so that alerts on 502s keep meaning "a node failed".
    return error_response(InternalError("internal error"), dialect_of_path(request.url.path))


def _bearer(request: Request) -> str:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _usage_authorizer(
    keys: KeyStore, admin_token: str | None
) -> Callable[[Request], Awaitable[Principal | None]]:
    """Who reads a usage report: the admin token -> every account, an API key -> its account."""

    async def authorize(request: Request) -> Principal | None:
        token = _bearer(request)
        if not token:
            return None
        if admin_token is not None and hmac.compare_digest(token.encode(), admin_token.encode()):
            return ADMIN
        return await keys.lookup(token)

    return authorize


async def _start_limiter(limiter: Limiter | None) -> None:
    # RedisLimiter heartbeats (live-gateway count) and renews its leases; LocalLimiter has no task.
    start = getattr(limiter, "start", None)
    if start is not None:
        await start()


async def _close_limiter(limiter: Limiter | None) -> None:
    close = getattr(limiter, "aclose", None)
    if close is not None:
        await close()


def create_app(
    settings: GatewaySettings,
    *,
    keys: KeyStore,
    placer: Placer,
    catalog: ModelCatalog | None = None,
    limiter: Limiter | None = None,
    limit_store: LimitStore | None = None,
    limit_policy: LimitPolicy | None = None,
    usage_sink: UsageSinkLike | None = None,
    ledger: Ledger | None = None,
    prices: PriceTable | None = None,
    is_ready: Callable[[], bool] = lambda: True,
    store_ping: Callable[[], Awaitable[object]] | None = None,
    on_startup: Callable[[], Awaitable[object]] | None = None,
    on_shutdown: Callable[[], Awaitable[object]] | None = None,
    telemetry: Telemetry | None = None,
    batches: BatchStore | None = None,
) -> ASGIApp:
    """The public gateway. `is_ready` gates requests (503 until it says yes: `edgeserve up` loading);
    `on_startup` / `on_shutdown` start and stop what the caller wired in (sinks, clients).

    The app starts and stops the limiter itself. `limit_store` (with `settings.admin_token`)
    mounts the limits admin API under /admin/v1; `ledger` mounts the usage report route.
    `telemetry` traces requests and backs /metrics (without it: metrics only, no spans).
    `settings.admin_token` also mounts the dashboard (/dashboard, gateway/dashboard/).
    `batches` keeps Workers AI's queued batches (in this process without it); the app runs
    their worker (gateway/batch/) while it serves.
    """
    if telemetry is None:
        telemetry = setup_telemetry(TelemetrySettings("edgeserve-gateway", is_tracing=False))
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(
            settings.node_read_timeout_s, connect=settings.node_connect_timeout_s
        ),
        limits=httpx.Limits(
            max_connections=settings.max_node_connections,
            max_keepalive_connections=settings.max_node_connections,
        ),
    )
    queue: CapacityQueue[Placement] = CapacityQueue(
        max_waiting=settings.max_queued, max_waiting_per_account=settings.max_queued_per_account
    )
    dispatcher = Dispatcher(
        client,
        placer,
        settings.internal_token,
        limiter,
        usage_sink,
        queue=queue,
        queue_deadline_s=settings.queue_deadline_s,
        tracer=GenAITracer(telemetry),
        node_silence_s=settings.node_silence_s,
        node_probe_timeout_s=settings.node_probe_timeout_s,
    )
    if batches is None:
        batches = LocalBatchStore(settings.batch_retention_s, settings.max_batch_queued_per_account)
    fleet = FleetGauges(placer, queue, telemetry.registry)
    recent_errors = RecentErrors()
    gateway = Gateway(
        settings=settings,
        catalog=catalog or ModelCatalog(),
        keys=keys,
        dispatcher=dispatcher,
        is_ready=is_ready,
    )

    async def openapi(request: Request) -> Response:
        return JSONBytes(build_openapi(request.app.routes))

    async def metrics(request: Request) -> Response:
        await fleet.refresh()
        body, content_type = telemetry.render_metrics()
        return Response(body, headers={"content-type": content_type})

    async def healthz(request: Request) -> Response:
        """200 when requests can be served: the model loaded. While the shared store (Redis,
        in a fleet) is away the status is `degraded`, still 200: only keys this gateway has
        seen recently are served (`scheduler/store_watch.py`), and Redis being away is every
        gateway's state at once, so a readiness probe that took them all out of service
        would turn a degraded fleet into a dead one."""
        if not gateway.is_ready():
            return JSONBytes({"status": "loading"}, status_code=503)
        if store_ping is not None:
            try:
                async with asyncio.timeout(STORE_PING_TIMEOUT_S):
                    await store_ping()
            except (RedisError, OSError, TimeoutError) as exc:
                if isinstance(exc, RedisError) and not is_store_unavailable(exc):
                    raise
                return JSONBytes({"status": "degraded", "store": "unavailable"})
        return JSONBytes({"status": "ok"}, status_code=200)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if on_startup is not None:
            await on_startup()
        await _start_limiter(limiter)
        await placer.start()
        batch_worker.start()
        try:
            yield
        finally:
            await batch_worker.aclose()  # a batch request in flight goes back to the queue
            await queue.aclose()
            await client.aclose()
            await placer.aclose()
            await _close_limiter(limiter)
            if on_shutdown is not None:
                await on_shutdown()

    routes = [
        Route(f"{ACCOUNT_AI}/run/{{model_name:path}}", workers_ai.run_model, methods=["POST"]),
        Route(f"{ACCOUNT_AI}/models/search", workers_ai.search_models, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    if ledger is not None:
        authorize = _usage_authorizer(keys, settings.admin_token)
        usage = usage_endpoint(ledger, prices or PriceTable.default(), authorize)
        routes.append(Route(f"{ACCOUNT_AI}/usage", usage, methods=["GET"]))
    if limit_store is not None and settings.admin_token is not None:
        admin = LimitsAdmin(limit_store, limit_policy or LimitPolicy(), settings.admin_token)
        routes += admin.routes("/admin/v1")
    if settings.admin_token is not None:
        dashboard = Dashboard(
            AdminToken(settings.admin_token),
            fleet,
            telemetry.registry,
            recent_errors,
            ledger,
            prices,
        )
        routes += dashboard.routes("/admin/v1")
    for base in ("/v1", f"{ACCOUNT_AI}/v1"):
        routes += [
            Route(f"{base}/chat/completions", openai_api.chat_completions, methods=["POST"]),
            Route(f"{base}/completions", openai_api.completions, methods=["POST"]),
            Route(f"{base}/embeddings", openai_api.embeddings, methods=["POST"]),
            Route(f"{base}/responses", responses_api.create_response, methods=["POST"]),
            Route(f"{base}/models", openai_api.list_models, methods=["GET"]),
            Route(f"{base}/models/{{model_id:path}}", openai_api.retrieve_model, methods=["GET"]),
        ]
    app = Starlette(
        routes=routes,
        exception_handlers={
            HTTPException: _http_exception,
            RedisError: _store_error,
            Exception: _unexpected,
        },
        lifespan=lifespan,
    )
    # A path with a trailing slash is not found, in the client's dialect: Starlette's
    # redirect would answer an empty 307 to a URL built from the Host header.
    app.router.redirect_slashes = False
    app.state.gateway = gateway
    app.state.batches = batches
    traffic = InteractiveTraffic(app)
    batch_worker = BatchWorker(
        batches,
        workers_ai.batch_runner(gateway),
        workers_ai.batch_model_of(gateway),
        Headroom(traffic, queue, placer, settings.batch_idle_s, settings.batch_max_node_load),
        WorkerSettings(concurrency=settings.batch_concurrency, claim_s=settings.batch_claim_s),
    )
    return RequestIdMiddleware(
        RecentErrorsMiddleware(TracingMiddleware(traffic, telemetry, app.routes), recent_errors)
    )
