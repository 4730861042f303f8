"""The node's internal HTTP API around one engine (versioned under /internal/v1/).

    POST   /internal/v1/generate        JSON in; NDJSON out: {"text", "token_ids"} chunks (the first
                                        also carries prompt_tokens and cached_tokens), then
                                        {"finish_reason", "usage": {prompt_tokens, completion_tokens,
                                        cached_tokens}}; a failure after the first line is one
                                        {"error": {"code", "message"}} line
    DELETE /internal/v1/requests/{id}   cancel a request (its pages are freed at once)
    GET    /internal/v1/health          200 once the model is loaded, 503 before and while draining
    GET    /internal/v1/capacity        the capacity record this node publishes

Every call needs `Authorization: Bearer <internal token>`. Errors before the
stream are JSON `{"error": {"code", "message"}}` with one of the codes in
`NodeErrorCode`, so the gateway can map them to its own dialects.

The node publishes its capacity record to the registry on a heartbeat; a
drain (SIGTERM) deregisters it first, refuses new work, and lets what runs finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gpu_node.errors import EngineStoppedError, InvalidRequestError
from scheduler.capacity import CapacityRecord, CapacityRegistry, load_estimate
from scheduler.sequence import SamplingParams

if TYPE_CHECKING:
    from gpu_node.async_engine import AsyncEngine

log = logging.getLogger(__name__)

NodeErrorCode = Literal[
    "unauthorized",
    "invalid_request",
    "request_too_large",
    "model_not_found",
    "over_capacity",
    "internal",
]
_STATUS: dict[str, int] = {
    "unauthorized": 401,
    "invalid_request": 400,
    "request_too_large": 413,
    "model_not_found": 404,
    "over_capacity": 503,
    "internal": 500,
}


def error_response(code: NodeErrorCode, message: str) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=_STATUS[code])


@dataclass(frozen=True)
class NodeSettings:
    node_id: str
    address: str  # the base URL gateways use to reach this node
    internal_token: str
    role: str = "mixed"
    heartbeat_s: float = 1.0
    ttl_s: float = 3.0  # a few heartbeats, so one late beat does not drop the node
    drain_timeout_s: float = 30.0
    max_num_seqs: int = 16  # for the load estimate: how many requests make one batch


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class GenerateRequest(BaseModel):
    """One generation, as the gateway sends it. Exactly one of the three prompt forms."""

    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(min_length=1, max_length=200)
    account_id: str = ""
    model: str
    prompt_token_ids: list[int] | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    raw: bool = False  # prompt as is; otherwise wrapped in the chat template as a user turn
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=tuple(self.stop),
            repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
        )


class NodeService:
    """The node's state: the engine once loaded, draining, the heartbeat and in-flight requests."""

    def __init__(
        self,
        settings: NodeSettings,
        registry: CapacityRegistry | None,
        engine: AsyncEngine | None = None,
        engine_factory: Callable[[], AsyncEngine] | None = None,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.engine = engine
        self._engine_factory = engine_factory
        # An engine handed in belongs to the caller (tests share one); a loaded one is ours to stop.
        self._owns_engine = engine is None
        self.is_draining = False
        self.load_error: str | None = None
        self.num_in_flight = 0
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def is_ready(self) -> bool:
        return self.engine is not None and not self.is_draining

    @property
    def model_name(self) -> str:
        assert self.engine is not None
        return self.engine.model_name

    async def start(self) -> None:
        if self.engine is None and self._engine_factory is not None:
            self._tasks.append(asyncio.create_task(self._load()))
        if self.registry is not None:
            self._tasks.append(asyncio.create_task(self._heartbeat()))

    async def _load(self) -> None:
        assert self._engine_factory is not None
        try:
            engine = await asyncio.to_thread(self._engine_factory)
            engine.start()
            self.engine = engine
            await self.publish()
        except Exception as exc:  # the node stays up and says why on /health
            log.exception("engine failed to load")
            self.load_error = f"{type(exc).__name__}: {exc}"

    def capacity_record(self) -> CapacityRecord | None:
        if self.engine is None:
            return None
        stats = self.engine.stats()
        return CapacityRecord(
            node_id=self.settings.node_id,
            address=self.settings.address,
            role=self.settings.role,
            models=(self.engine.model_name,),
            num_pages=stats.num_pages,
            num_free_pages=stats.num_free_pages,
            page_size=stats.page_size,
            kv_dtype=stats.kv_dtype,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            load=load_estimate(
                stats.num_pages, stats.num_free_pages, stats.num_waiting, self.settings.max_num_seqs
            ),
            published_at=time.time(),
            ttl_s=self.settings.ttl_s,
        )

    async def publish(self) -> None:
        record = self.capacity_record()
        if self.registry is not None and record is not None and not self.is_draining:
            await self.registry.publish(record)

    async def _heartbeat(self) -> None:
        while not self.is_draining:
            try:
                await self.publish()
            except Exception:  # Redis away for a beat: the TTL decides, keep beating
                log.warning("capacity heartbeat failed", exc_info=True)
            await asyncio.sleep(self.settings.heartbeat_s)

    async def begin_drain(self) -> None:
        """Stop taking work and leave the registry so no gateway places here any more."""
        self.is_draining = True
        if self.registry is not None:
            with contextlib.suppress(Exception):
                await self.registry.remove(self.settings.node_id)

    async def stop(self) -> None:
        await self.begin_drain()
        deadline = time.monotonic() + self.settings.drain_timeout_s
        while self.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        if self.engine is not None and self._owns_engine:
            await asyncio.to_thread(self.engine.shutdown)

    def prompt_token_ids(self, body: GenerateRequest) -> list[int]:
        assert self.engine is not None
        tokenizer = self.engine.tokenizer
        if body.prompt_token_ids is not None:
            return body.prompt_token_ids
        if body.messages is not None:
            text = tokenizer.apply_chat_template([m.model_dump() for m in body.messages])
        elif body.raw:
            text = body.prompt or ""
        else:
            text = tokenizer.apply_chat_template([{"role": "user", "content": body.prompt or ""}])
        return tokenizer.encode(text)


class InternalTokenAuth:
    """Pure-ASGI check of the internal bearer token on every HTTP call."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self._expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                response = error_response("unauthorized", "missing or wrong internal token")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


async def generate(request: Request) -> Response:
    """Run one generation and stream it back as NDJSON (see the module docstring)."""
    service: NodeService = request.app.state.service
    if service.engine is None or service.is_draining:
        why = "draining" if service.is_draining else "the model is still loading"
        return error_response("over_capacity", f"node not accepting requests: {why}")
    try:
        body = GenerateRequest.model_validate_json(await request.body())
    except ValidationError as exc:
        return error_response("invalid_request", _describe(exc))
    if body.model != service.model_name:
        return error_response(
            "model_not_found", f"this node serves {service.model_name!r}, not {body.model!r}"
        )
    given = [body.prompt_token_ids is not None, body.prompt is not None, body.messages is not None]
    if sum(given) != 1:
        return error_response(
            "invalid_request", "give exactly one of prompt_token_ids, prompt, messages"
        )
    params = body.sampling_params()
    if problems := params.problems():
        return error_response("invalid_request", "; ".join(problems))
    engine = service.engine
    try:
        prompt_ids = service.prompt_token_ids(body)
    except Exception as exc:  # a template that rejects the conversation
        return error_response("invalid_request", f"cannot build the prompt: {exc}")
    if not prompt_ids:
        return error_response("invalid_request", "the prompt is empty")
    if len(prompt_ids) + params.max_tokens > engine.max_model_len:
        return error_response(
            "request_too_large",
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
            f"context window of {engine.max_model_len} tokens",
        )

    outputs = engine.generate(body.request_id, prompt_ids, params, cache_salt=body.account_id)
    service.num_in_flight += 1
    try:
        # The engine validates before yielding anything: pull the first output here so its
        # errors become a status code, not a broken stream.
        first = await anext(outputs)
    except InvalidRequestError as exc:
        service.num_in_flight -= 1
        return error_response("invalid_request", str(exc))
    except EngineStoppedError:
        service.num_in_flight -= 1
        return error_response("over_capacity", "the engine is stopping")
    except BaseException:
        service.num_in_flight -= 1
        engine.abort(body.request_id)
        raise
    return StreamingResponse(
        _stream(service, body.request_id, first, outputs), media_type="application/x-ndjson"
    )


async def _stream(
    service: NodeService, request_id: str, first: Any, outputs: AsyncIterator[Any]
) -> AsyncIterator[bytes]:
    assert service.engine is not None
    engine = service.engine
    finished = False
    is_first = True
    try:
        out = first
        while True:
            if out.token_ids or out.text or is_first:
                chunk: dict[str, Any] = {"text": out.text, "token_ids": list(out.token_ids)}
                if is_first:
                    # What the gateway bills if the stream ends early, before the final usage.
                    chunk["prompt_tokens"] = out.num_prompt_tokens
                    chunk["cached_tokens"] = out.num_cached_tokens
                    is_first = False
                yield _line(chunk)
            if out.finished:
                finished = True
                if out.finish_reason == "error":
                    yield _line(
                        {"error": {"code": "internal", "message": out.error or "engine error"}}
                    )
                    return
                usage = {
                    "prompt_tokens": out.num_prompt_tokens,
                    "completion_tokens": out.num_completion_tokens,
                    "cached_tokens": out.num_cached_tokens,
                }
                yield _line({"finish_reason": out.finish_reason, "usage": usage})
                return
            out = await anext(outputs)
    except StopAsyncIteration:
        yield _line(
            {"error": {"code": "internal", "message": "the engine ended the request early"}}
        )
    except Exception as exc:
        log.exception("generation %s failed", request_id)
        yield _line({"error": {"code": "internal", "message": f"{type(exc).__name__}: {exc}"}})
    finally:
        service.num_in_flight -= 1
        if not finished:
            # The client went away (or the stream broke): free the pages now, not at GC time.
            engine.abort(request_id)


async def cancel(request: Request) -> Response:
    service: NodeService = request.app.state.service
    if service.engine is not None:
        service.engine.abort(request.path_params["request_id"])
    return Response(status_code=204)


async def health(request: Request) -> Response:
    service: NodeService = request.app.state.service
    if service.load_error is not None:
        return JSONResponse({"status": "failed", "error": service.load_error}, status_code=503)
    if service.is_draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    if service.engine is None:
        return JSONResponse({"status": "loading"}, status_code=503)
    return JSONResponse(
        {"status": "ok", "node_id": service.settings.node_id, "model": service.model_name}
    )


async def capacity(request: Request) -> Response:
    service: NodeService = request.app.state.service
    record = service.capacity_record()
    if record is None:
        return error_response("over_capacity", "the model is still loading")
    return Response(record.to_json(), media_type="application/json")


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False):
        where = ".".join(str(p) for p in err["loc"]) or "body"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


def create_node_app(service: NodeService) -> ASGIApp:
    """The node's ASGI app; starting it starts the service (loading, heartbeat), stopping it drains."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    app = Starlette(
        routes=[
            Route("/internal/v1/generate", generate, methods=["POST"]),
            Route("/internal/v1/requests/{request_id}", cancel, methods=["DELETE"]),
            Route("/internal/v1/health", health, methods=["GET"]),
            Route("/internal/v1/capacity", capacity, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
    app.state.service = service
    return InternalTokenAuth(app, service.settings.internal_token)
