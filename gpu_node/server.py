"""The node's internal HTTP API around one engine (versioned under /internal/v1/).

    POST   /internal/v1/generate        JSON in; NDJSON out: {"text", "token_ids"} chunks (the first
                                        also carries prompt_tokens, cached_tokens and
                                        prefilled_tokens: what billing counts if the stream
                                        ends early), then
                                        {"finish_reason", "usage": {prompt_tokens, completion_tokens,
                                        cached_tokens}}; a failure after the first line is one
                                        {"error": {"code", "message"}} line. With "prefill_from"
                                        (a prefill node's base URL) the prompt runs there and
                                        its KV comes here (gpu_node/engine/handoff.py); this node decodes.
                                        "grammar", "logprobs" and "n": common/node_api.py
    POST   /internal/v1/prefill         the same JSON in; out the prompt's KV handoff (octet-stream):
                                        the prompt and its first token, run for a decode node
    POST   /internal/v1/embed           {"model", "texts" | "token_ids", "truncate"} in; out
                                        {"vectors", "prompt_tokens"} from the encoder served
                                        beside the engine (gpu_node/engine/embedder.py)
    DELETE /internal/v1/requests/{id}   cancel a request (its pages are freed at once); one
                                        not here yet is refused when it comes (409 cancelled)
    GET    /internal/v1/health          200 once the model is loaded, 503 before and while draining
    GET    /internal/v1/capacity        the capacity record this node publishes

Every call needs `Authorization: Bearer <internal token>`. Errors before the
stream are JSON `{"error": {"code", "message"}}` with one of the codes in
`common.node_api.NodeErrorCode`, so the gateway can map them to its own dialects.

The node publishes its capacity record to the registry on a heartbeat; a
drain (SIGTERM) deregisters it first, refuses new work, and lets what runs finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from billing.errors import InvalidUsageEvent
from billing.events import Status, UsageEvent
from common.node_api import (
    EmbedRequest,
    EmbedResponse,
    ErrorEvent,
    Finish,
    GenerateRequest,
    NodeError,
    NodeErrorCode,
    TokenChunk,
    TokenLogprob,
    TopLogprob,
    Usage,
    event_line,
)
from common.telemetry import Telemetry, TelemetrySettings, setup_telemetry
from common.window import Window
from gpu_node.engine.outputs import SampledLogprob, ends_request
from gpu_node.errors import (
    EngineError,
    EngineStoppedError,
    InvalidGrammarError,
    InvalidRequestError,
    RequestCancelledError,
    RequestTooLargeError,
)
from gpu_node.service import NodeService, NodeSettings, sampling_params
from gpu_node.telemetry import NodeSpan, NodeTelemetry
from scheduler.sequence import SamplingParams

if TYPE_CHECKING:
    from gpu_node.engine.grammar import Grammar
    from gpu_node.models.tokenizer import ChatTokenizer

__all__ = ["NodeService", "NodeSettings", "create_node_app"]

log = logging.getLogger(__name__)

Body = TypeVar("Body", bound=BaseModel)


@dataclass(frozen=True)
class _Refusal:
    status: int
    error: type[EngineError] | None = None  # the engine's error answered with this code
    words: str | None = None  # what the client reads in place of the error's own words


# Every refusal of the node API, one row a code: its HTTP status and the engine's error
# that answers with it.
_REFUSALS: dict[NodeErrorCode, _Refusal] = {
    "unauthorized": _Refusal(401),
    "invalid_request": _Refusal(400, InvalidRequestError),
    "invalid_grammar": _Refusal(400, InvalidGrammarError),
    "request_too_large": _Refusal(413, RequestTooLargeError),
    "model_not_found": _Refusal(404),
    "over_capacity": _Refusal(503, EngineStoppedError, "the engine is stopping"),
    # cancelled before it arrived: the DELETE overtook the POST
    "cancelled": _Refusal(409, RequestCancelledError),
    "internal": _Refusal(500),
}
_CODE_OF: dict[type[EngineError], NodeErrorCode] = {
    refusal.error: code for code, refusal in _REFUSALS.items() if refusal.error is not None
}
REFUSALS = tuple(_CODE_OF)


def _known_code(code: str) -> NodeErrorCode:
    """Another node's error code as ours ("internal" for one we do not know)."""
    return next((known for known in _REFUSALS if known == code), "internal")


def error_response(code: NodeErrorCode, message: str) -> Response:
    body = ErrorEvent(error=NodeError(code=code, message=message))
    status = _REFUSALS[code].status
    return Response(body.model_dump_json(), status, media_type="application/json")


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


@dataclass(frozen=True)
class _Call:
    """A generate or prefill call that passed the checks every call gets."""

    service: NodeService
    body: GenerateRequest
    params: SamplingParams
    prompt_ids: list[int]
    grammar: Grammar | None = None  # compiled off the event loop and the engine thread


async def _parsed(request: Request, schema: type[Body]) -> Body | Response:
    """The request's JSON body as `schema`; an invalid_request answer naming what is wrong."""
    try:
        return schema.model_validate_json(await request.body())
    except ValidationError as exc:
        return error_response("invalid_request", _describe(exc))


async def _checked(request: Request) -> _Call | Response:
    """The body parsed and checked, the prompt tokenized; an error response otherwise."""
    service: NodeService = request.app.state.service
    if service.engine is None or service.is_draining:
        why = "draining" if service.is_draining else "the model is still loading"
        return error_response("over_capacity", f"node not accepting requests: {why}")
    body = await _parsed(request, GenerateRequest)
    if isinstance(body, Response):
        return body
    if body.model != service.model_name:
        return error_response(
            "model_not_found", f"this node serves {service.model_name!r}, not {body.model!r}"
        )
    given = [body.prompt_token_ids is not None, body.prompt is not None, body.messages is not None]
    if sum(given) != 1:
        return error_response(
            "invalid_request", "give exactly one of prompt_token_ids, prompt, messages"
        )
    params = sampling_params(body)
    if problems := params.problems():
        return error_response("invalid_request", "; ".join(problems))
    engine = service.engine
    try:
        prompt_ids = service.prompt_token_ids(body)
    except Exception as exc:  # a template that rejects the conversation
        return error_response("invalid_request", f"cannot build the prompt: {exc}")
    if not prompt_ids:
        return error_response("invalid_request", "the prompt is empty")
    window = Window(engine.max_request_tokens, engine.max_model_len)
    if body.max_tokens_is_default:
        # The client named no max_tokens: the answer may run to the end of the context.
        max_tokens = window.fit_max_tokens(params.max_tokens, len(prompt_ids))
        params = replace(params, max_tokens=max_tokens)
    refusal = window.refusal(
        params.max_tokens, len(prompt_ids), is_default=body.max_tokens_is_default
    )
    if refusal is not None:
        return error_response("request_too_large", refusal)
    if body.n > 1 and body.prefill_from is not None:
        return error_response("invalid_request", "n > 1 cannot be prefilled on another node")
    grammar = None
    if body.grammar is not None:
        try:
            grammar = await asyncio.to_thread(engine.compile_grammar, body.grammar)
        except InvalidRequestError as exc:
            return error_response(*_refusal(exc))
        except EngineError as exc:  # no grammar library on this node
            return error_response("internal", str(exc))
    return _Call(service, body, params, prompt_ids, grammar)


def _refusal(exc: EngineError) -> tuple[NodeErrorCode, str]:
    """The code and the words the engine's refusal `exc` is answered with."""
    code = next(_CODE_OF[cls] for cls in type(exc).__mro__ if cls in _CODE_OF)
    return code, _REFUSALS[code].words or str(exc)


def _refused(exc: EngineError, span: NodeSpan, code: NodeErrorCode | None = None) -> Response:
    """The answer to a request the engine refused (`code` in place of its own)."""
    own, message = _refusal(exc)
    code = code or own
    span.fail(code, message)
    return error_response(code, message)


async def prefill(request: Request) -> Response:
    """Run a prompt and its first token for a decode node: the KV handoff's bytes."""
    started_ns = time.time_ns()
    call = await _checked(request)
    if isinstance(call, Response):
        return call
    service, body = call.service, call.body
    if body.prefill_from is not None:
        return error_response(
            "invalid_request", "a prefill call cannot itself be prefilled elsewhere"
        )
    assert service.engine is not None
    telemetry: NodeTelemetry = request.app.state.telemetry
    span = telemetry.start(request.headers, body, len(call.prompt_ids), started_ns, "prefill")
    service.num_in_flight += 1
    try:
        final = None
        async for out in service.engine.generate(
            body.request_id, call.prompt_ids, call.params, body.account_id, prefill_only=True,
            grammar=call.grammar,
        ):  # fmt: skip
            final = out
    except REFUSALS as exc:
        return _refused(exc, span)
    finally:
        service.num_in_flight -= 1
    if final is None or final.handoff is None:
        message = final.error if final is not None and final.error else "no KV was handed off"
        span.fail("engine_error", message)
        return error_response("internal", f"prefill failed: {message}")
    span.finish(final)
    return Response(final.handoff.to_bytes(), media_type="application/octet-stream")


async def embed(request: Request) -> Response:
    """The vectors of a request's texts (or token arrays) from the encoder served here."""
    service: NodeService = request.app.state.service
    embedder, queue = service.embedder, service.embed_queue()
    if embedder is None or queue is None or not service.is_ready:
        why = "it serves no encoder" if embedder is None else "not accepting requests"
        return error_response("over_capacity", f"node cannot embed: {why}")
    body = await _parsed(request, EmbedRequest)
    if isinstance(body, Response):
        return body
    if body.model != embedder.name:
        return error_response(
            "model_not_found", f"this node embeds with {embedder.name!r}, not {body.model!r}"
        )
    if (body.texts is None) == (body.token_ids is None):
        return error_response("invalid_request", "give exactly one of texts, token_ids")
    try:
        if body.texts is not None:
            ids = embedder.tokenize(body.texts, truncate=body.truncate)
        else:
            ids = body.token_ids or []
            embedder.check_ids(ids)
        result = await queue.embed(ids)
    except EngineError as exc:
        return error_response(*_refusal(exc))
    response = EmbedResponse(vectors=result.vectors.tolist(), prompt_tokens=result.num_tokens)
    return Response(response.model_dump_json(), media_type="application/json")


async def generate(request: Request) -> Response:
    """Run one generation and stream it back as NDJSON (see the module docstring)."""
    started_ns = time.time_ns()
    call = await _checked(request)
    if isinstance(call, Response):
        return call
    service, body, params, prompt_ids = call.service, call.body, call.params, call.prompt_ids
    engine = service.engine
    assert engine is not None
    telemetry: NodeTelemetry = request.app.state.telemetry
    span = telemetry.start(request.headers, body, len(prompt_ids), started_ns)
    handoff = None
    if body.prefill_from is not None:  # the prompt runs on that node; its KV comes here
        fetched = await service.fetch_handoff(body, prompt_ids, span.traceparent())
        if isinstance(fetched, tuple):
            code, message = _known_code(fetched[0]), fetched[1]
            span.fail(code, message)
            return error_response(code, message)
        handoff = fetched
    outputs = engine.generate(
        body.request_id, prompt_ids, params, cache_salt=body.account_id, handoff=handoff,
        grammar=call.grammar, n=body.n,
    )  # fmt: skip
    service.num_in_flight += 1
    try:
        # The engine validates before yielding anything: pull the first output here so its
        # errors become a status code, not a broken stream.
        first = await anext(outputs)
    except REFUSALS as exc:
        service.num_in_flight -= 1
        # A handoff this node cannot take is the fleet's fault, not the client's.
        is_handoff = handoff is not None and isinstance(exc, InvalidRequestError)
        return _refused(exc, span, "internal" if is_handoff else None)
    except BaseException as exc:
        service.num_in_flight -= 1
        span.fail(type(exc).__qualname__)
        engine.abort(body.request_id)
        raise
    return StreamingResponse(
        _stream(service, body, first, outputs, span, started_ns / 1e9),
        media_type="application/x-ndjson",
    )


async def _stream(
    service: NodeService,
    body: GenerateRequest,
    first: Any,
    outputs: AsyncIterator[Any],
    span: NodeSpan,
    started_at: float,
) -> AsyncIterator[bytes]:
    assert service.engine is not None
    engine = service.engine
    request_id = body.request_id
    finished = False
    started: set[int] = set()  # the choices whose first chunk is out
    num_finished = 0  # choices finished
    status: Status = "cancelled"
    num_sent = 0  # tokens written toward the gateway
    out = first
    try:
        while True:
            is_first = out.index not in started
            if out.token_ids or out.text or is_first:
                chunk = TokenChunk(
                    text=out.text,
                    token_ids=list(out.token_ids),
                    logprobs=_token_logprobs(engine.tokenizer, out.logprobs),
                    index=out.index,
                )
                if is_first:
                    # What the gateway bills if the stream ends early, before the final usage.
                    chunk = chunk.model_copy(
                        update={
                            "prompt_tokens": out.num_prompt_tokens,
                            "cached_tokens": out.num_cached_tokens,
                            "prefilled_tokens": out.num_prefilled_tokens,
                        }
                    )
                    started.add(out.index)
                yield event_line(chunk)
                num_sent += len(out.token_ids)
            if out.finished:
                num_finished += 1
                if out.finish_reason == "error":
                    finished = num_finished == body.n  # the other choices are aborted below
                    status = "error"
                    span.finish(out)
                    yield _error_line(out.error or "engine error")
                    return
                usage = Usage(
                    prompt_tokens=out.num_prompt_tokens,
                    completion_tokens=out.num_completion_tokens,
                    cached_tokens=out.num_cached_tokens,
                )
                yield event_line(
                    Finish(finish_reason=out.finish_reason, usage=usage, index=out.index)
                )
                if ends_request(out, num_finished, body.n):
                    finished = True
                    status = "ok"
                    span.finish(out)
                    return
            out = await anext(outputs)
    except StopAsyncIteration:
        status = "error"
        span.fail("engine_error", "the engine ended the request early")
        yield _error_line("the engine ended the request early")
    except Exception as exc:
        status = "error"
        log.exception("generation %s failed", request_id)
        span.fail(type(exc).__qualname__, str(exc))
        yield _error_line(f"{type(exc).__name__}: {exc}")
    finally:
        if service.usage_sink is not None:
            _record_node_usage(service, body, out, num_sent, status, started_at)
        service.num_in_flight -= 1
        span.fail("cancelled")  # a no-op once the span ended
        if not finished:
            # The client went away (or the stream broke): free the pages now, not at GC time.
            engine.abort(request_id)


def _token_logprobs(
    tokenizer: ChatTokenizer, logprobs: tuple[SampledLogprob, ...] | None
) -> list[TokenLogprob] | None:
    """The engine's log-probabilities on the wire, each token with its text."""
    if logprobs is None:
        return None

    def text(token: int) -> str:
        return tokenizer.decode([token], skip_special_tokens=False)

    return [
        TokenLogprob(
            token_id=lp.token_id,
            token=text(lp.token_id),
            logprob=lp.logprob,
            top=[TopLogprob(token_id=t, token=text(t), logprob=v) for t, v in lp.top],
        )
        for lp in logprobs
    ]


def _error_line(message: str) -> bytes:
    return event_line(ErrorEvent(error=NodeError(code="internal", message=message)))


def _record_node_usage(
    service: NodeService,
    body: GenerateRequest,
    last: Any,
    num_sent: int,
    status: Status,
    started_at: float,
) -> None:
    """The node's record of a request it served: its prompt as computed, the tokens it
    sent toward the gateway, and how it ended here."""
    try:
        event = UsageEvent(
            request_id=body.request_id,
            account_id=body.account_id,
            model=body.model,
            node_id=service.settings.node_id,
            input_tokens=last.num_prefilled_tokens,
            output_tokens=num_sent,
            cached_tokens=min(last.num_cached_tokens, last.num_prefilled_tokens),
            started_at=started_at,
            ended_at=max(time.time(), started_at),
            status=status,
            kind="node",
        )
    except InvalidUsageEvent as exc:  # a caller that named no account: nothing to bill
        log.warning("no usage record for %s: %s", body.request_id, exc)
        return
    service.record_usage(event)


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


async def metrics(request: Request) -> Response:
    """GET /metrics: engine gauges and counters, the engine-side GenAI histograms."""
    telemetry: NodeTelemetry = request.app.state.telemetry
    body, content_type = telemetry.telemetry.render_metrics()
    return Response(body, headers={"content-type": content_type})


def create_node_app(service: NodeService, telemetry: Telemetry | None = None) -> ASGIApp:
    """The node's ASGI app; starting it starts the service (loading, heartbeat), stopping it drains.

    `telemetry` traces generations (continuing the gateway's trace) and backs /metrics.
    """

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
            Route("/internal/v1/prefill", prefill, methods=["POST"]),
            Route("/internal/v1/embed", embed, methods=["POST"]),
            Route("/internal/v1/requests/{request_id}", cancel, methods=["DELETE"]),
            Route("/internal/v1/health", health, methods=["GET"]),
            Route("/internal/v1/capacity", capacity, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
    app.state.service = service
    app.state.telemetry = NodeTelemetry(
        telemetry or setup_telemetry(TelemetrySettings("edgeserve-node", is_tracing=False)),
        service.settings.node_id,
        lambda: None if service.engine is None else service.engine.stats(),
    )
    return InternalTokenAuth(app, service.settings.internal_token)
