"""The Workers AI dialect: `/client/v4/accounts/{account_id}/ai/...` in the Cloudflare envelope."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Receive

from gateway.batch.store import BatchStore
from gateway.batch.worker import BatchRequest, ModelOf, Runner
from gateway.catalog import CatalogModel
from gateway.errors import (
    BadRequestError,
    GatewayError,
    ModelNotFoundError,
    NotFoundError,
    RateLimitedError,
    UnsupportedError,
    error_body,
)
from gateway.http import (
    Gateway,
    JSONBytes,
    authenticate,
    endpoint,
    gateway_of,
    parse_body,
    request_id_of,
    require_ready,
    resolve_model,
    session_id_of,
    settled,
    validation_error,
)
from gateway.jobs import EmbeddingJob, GenerationJob, estimate_input_tokens
from gateway.metering import estimate_tokens
from gateway.relay import SSE_DONE, RelayResponse, sse
from gateway.schemas import (
    WorkersAIBatchRequest,
    WorkersAIEmbeddingRequest,
    WorkersAITextRequest,
)
from gateway.tool_calls import CallStart, Content, ToolCallReader
from gateway.upstream import ChoiceEnd, Finished, TextChunk, Upstream, collect

BATCH_FULL_RETRY_S = 30.0  # a full batch queue drains at the pace of low-priority work


def envelope(result: Any) -> dict[str, Any]:
    return {"result": result, "success": True, "errors": [], "messages": []}


def usage(finished: Finished) -> dict[str, int]:
    return {
        "prompt_tokens": finished.prompt_tokens,
        "completion_tokens": finished.completion_tokens,
        "total_tokens": finished.prompt_tokens + finished.completion_tokens,
    }


def tool_calls(reader: ToolCallReader) -> list[dict[str, Any]]:
    """Workers AI's `tool_calls`: each call's name and its arguments as an object."""
    calls = []
    for name, arguments in zip(reader.names, reader.arguments, strict=True):
        try:
            parsed = json.loads(arguments)
        except ValueError:  # cut short by max_tokens: its text as far as it went
            parsed = arguments
        calls.append({"name": name, "arguments": parsed})
    return calls


class WorkersAIStream:
    """`data: {"response": "..."}` per chunk, a last chunk with `usage` (and, with tools
    offered, the `tool_calls` made), then `data: [DONE]`."""

    def __init__(self, reads_tools: bool = False) -> None:
        self._reader = ToolCallReader() if reads_tools else None

    def start(self) -> bytes:
        return b""

    def chunk(self, chunk: TextChunk) -> bytes:
        if self._reader is None:
            return sse({"response": chunk.text}) if chunk.text else b""
        pieces = self._reader.feed(chunk.text)
        return b"".join(sse({"response": p.text}) for p in pieces if isinstance(p, Content))

    def end_choice(self, end: ChoiceEnd) -> bytes:
        return b""  # one choice only

    def finish(self, finished: Finished) -> bytes:
        last: dict[str, Any] = {"response": "", "usage": usage(finished)}
        if self._reader is not None:
            pieces = self._reader.finish()
            last["response"] = "".join(p.text for p in pieces if isinstance(p, Content))
            if self._reader.num_calls or any(isinstance(p, CallStart) for p in pieces):
                last["tool_calls"] = tool_calls(self._reader)
        return sse(last) + SSE_DONE

    def error(self, error: GatewayError) -> bytes:
        return sse(error_body(error, "workers_ai"))


@endpoint("workers_ai")
async def run_model(request: Request) -> Response:
    """POST /client/v4/accounts/{account_id}/ai/run/{model_name}: text generation, or text
    embeddings for an embedding model; with `?queueRequest=true`, the async batch API."""
    account_id = await authenticate(request)
    require_ready(request)
    model = await resolve_model(request, request.path_params["model_name"])
    if _flag(request, "queueRequest"):
        return await _batch(request, account_id, model)
    if model.is_embedding:
        return await _embed(request, account_id, model)
    body = await parse_body(request, WorkersAITextRequest)
    body.check_supported()
    if body.stream:
        upstream = await gateway_of(request).dispatcher.open(
            _generation_job(request_id_of(request), account_id, model, body, request),
            request.receive,
        )
        stream = WorkersAIStream(body.offers_tools)
        return RelayResponse(upstream, stream, upstream.headers)  # type: ignore[return-value]
    result, upstream = await generate(
        gateway_of(request),
        _generation_job(request_id_of(request), account_id, model, body, request),
        body.offers_tools,
        request.receive,
    )
    return await settled(upstream, lambda: envelope(result))


def _generation_job(
    request_id: str,
    account_id: str,
    model: CatalogModel,
    body: WorkersAITextRequest,
    request: Request | None = None,
) -> GenerationJob:
    payload = body.node_payload(model.sampling)
    return GenerationJob(
        request_id,
        account_id,
        model,
        payload,
        estimate_tokens(payload),
        # a batch request (no client request) never waits in the capacity queue
        reject_if_busy=body.reject_if_busy or request is None,
        stream=body.stream and request is not None,
        session_id=None if request is None else session_id_of(request),
    )


async def generate(
    gateway: Gateway, job: GenerationJob, offers_tools: bool, receive: Receive
) -> tuple[dict[str, Any], Upstream]:
    """A whole generation's `result` (response, tool calls, usage) and its upstream, left
    open: the caller closes it (`settled`, for a client)."""
    upstream = await gateway.dispatcher.open(job, receive)
    (choice,), finished = await collect(upstream, receive, keep_open=True)
    try:
        result: dict[str, Any] = {"response": choice.text}
        if offers_tools:
            reader = ToolCallReader()
            pieces = reader.feed(choice.text) + reader.finish()
            result["response"] = "".join(p.text for p in pieces if isinstance(p, Content))
            if reader.names:
                result["tool_calls"] = tool_calls(reader)
    except BaseException:
        await asyncio.shield(upstream.close())
        raise
    return result | {"usage": usage(finished)}, upstream


async def _batch(request: Request, account_id: str, model: CatalogModel) -> Response:
    """Queues a batch (`requests`) and answers its id at once, or answers a queued batch's
    status, then its answers (`request_id`); another account's batch is not found."""
    batches: BatchStore = request.app.state.batches
    body = await parse_body(request, WorkersAIBatchRequest)
    if body.request_id is not None:
        view = await batches.get(account_id, body.request_id)
        if view is None:
            raise NotFoundError(f"no queued request {body.request_id!r} for this account")
        return JSONBytes(envelope(view.result()))
    assert body.requests is not None
    if model.is_embedding:
        raise UnsupportedError("queueRequest is served for text generation models only")
    most = gateway_of(request).settings.max_batch_requests
    if len(body.requests) > most:
        raise BadRequestError(
            f"a batch holds at most {most} requests, got {len(body.requests)}", param="requests"
        )
    batch_id = await batches.submit(account_id, model.name, body.requests)
    if batch_id is None:
        raise RateLimitedError(
            "this account's batch queue is full; poll its batches and retry when they are done",
            retry_after_s=BATCH_FULL_RETRY_S,
        )
    return JSONBytes(envelope({"status": "queued", "request_id": batch_id, "model": model.name}))


async def _no_client() -> Message:
    """A batch request's `receive`: nobody is there to leave."""
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


def batch_runner(gateway: Gateway) -> Runner:
    """Runs one request of a batch as `run_model` runs a whole answer (the worker's Runner)."""

    async def run(request: BatchRequest) -> dict[str, Any]:
        model = gateway.catalog.resolve(request.model, await gateway.dispatcher.served_models())
        if model is None:
            raise ModelNotFoundError(f"no such model: {request.model!r}", param="model")
        if not isinstance(request.body, dict):
            raise BadRequestError("each of 'requests' must be a JSON object")
        try:
            body = WorkersAITextRequest.model_validate(request.body)
        except ValidationError as exc:
            raise validation_error(exc) from None
        body.check_supported()
        job = _generation_job(request.request_id, request.account_id, model, body)
        result, upstream = await generate(gateway, job, body.offers_tools, _no_client)
        await asyncio.shield(upstream.close())  # no client: its end is recorded at once
        return result

    return run


def batch_model_of(gateway: Gateway) -> ModelOf:
    """The node model a batch's public model name runs on (None: no such model)."""

    async def node_model(name: str) -> str | None:
        model = gateway.catalog.resolve(name, await gateway.dispatcher.served_models())
        return None if model is None else model.node_model

    return node_model


async def _embed(request: Request, account_id: str, model: CatalogModel) -> Response:
    """Workers AI's text embeddings: `{"shape": [n, d], "data": [[...], ...]}`."""
    body = await parse_body(request, WorkersAIEmbeddingRequest)
    body.check_supported()
    texts = body.texts()
    job = EmbeddingJob(
        request_id_of(request),
        account_id,
        model,
        texts,
        None,
        estimate_input_tokens(texts, None, model.context_window),
        truncate=body.truncate_inputs,
        reject_if_busy=body.reject_if_busy,
        session_id=session_id_of(request),
    )
    answer, headers = await gateway_of(request).dispatcher.embed(job, request.receive)
    vectors = answer.vectors
    shape = [len(vectors), len(vectors[0]) if vectors else 0]
    return JSONBytes(envelope({"shape": shape, "data": vectors}), headers=headers)


def _positive_int(request: Request, name: str, default: int, most: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadRequestError(f"{name} must be an integer, got {raw!r}") from None
    if not 1 <= value <= most:
        raise BadRequestError(f"{name} must be between 1 and {most}, got {value}")
    return value


def _flag(request: Request, name: str) -> bool:
    raw = request.query_params.get(name)
    if raw is None or raw.lower() == "false":
        return False
    if raw.lower() == "true":
        return True
    raise BadRequestError(f"{name} must be true or false, got {raw!r}")


@endpoint("workers_ai")
async def search_models(request: Request) -> Response:
    """GET /client/v4/accounts/{account_id}/ai/models/search: the models live nodes serve,
    filtered (search, task, author, hide_experimental) and paginated as Workers AI does."""
    await authenticate(request)
    page = _positive_int(request, "page", 1, 1_000_000)
    per_page = _positive_int(request, "per_page", 20, 100)
    gateway = gateway_of(request)
    models = gateway.catalog.served(await gateway.dispatcher.served_models())
    if search := request.query_params.get("search"):
        models = [m for m in models if search.lower() in (m.name + " " + m.description).lower()]
    if task := request.query_params.get("task"):
        models = [m for m in models if m.task.lower() == task.lower()]
    if author := request.query_params.get("author"):
        models = [m for m in models if m.author.lower() == author.lower()]
    if _flag(request, "hide_experimental"):
        models = [m for m in models if not m.is_experimental]
    start = (page - 1) * per_page
    dispatcher = gateway_of(request).dispatcher
    result = [
        m.search_entry(await dispatcher.context_window(m)) for m in models[start : start + per_page]
    ]
    return JSONBytes(
        envelope(result)
        | {
            "result_info": {
                "page": page,
                "per_page": per_page,
                "count": len(result),
                "total_count": len(models),
            }
        }
    )
