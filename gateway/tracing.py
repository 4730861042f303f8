"""Gateway tracing: the HTTP server span (pure ASGI) and the GenAI span of each generation.

One request is one trace; the node continues it from the W3C `traceparent` the
gateway forwards:

    POST /v1/chat/completions                       SERVER    TracingMiddleware
    └── chat @cf/huggingface/smollm2-135m-instruct  CLIENT    GenAISpan (Dispatcher.open -> close)
        ├── admission                               INTERNAL  GenAISpan.step
        ├── placement                               INTERNAL  (one per node tried)
        └── generate smollm2                        SERVER    the node (gpu_node.telemetry)
              events: queued, admitted, first_token, preempted, finished (+ KV pages held)

Attribute names follow the OpenTelemetry GenAI and HTTP semantic conventions; our
own live under `edgeserve.*`. Prompt and completion text are recorded only when
`TelemetrySettings.record_content` is on. The GenAI metrics are recorded when the
GenAI span ends, so they exist even when traces are off or not sampled.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.node_api import ChatMessage, GenerateParams
from common.telemetry import (
    PROPAGATOR,
    PROVIDER_NAME,
    AdmissionMetrics,
    GenAILabels,
    Telemetry,
    current_request_id,
)
from gateway.jobs import EmbeddingJob, GenerationJob, Job

if TYPE_CHECKING:
    from scheduler.placement import Placement

log = logging.getLogger(__name__)


class TracingMiddleware:
    """The server span of every HTTP request, made current so handlers' spans nest under it.

    Sits inside RequestIdMiddleware (it reads the request id from the scope). A
    client's own `traceparent` becomes a link, not the parent: the public edge starts
    its own traces, so a client cannot force sampling or graft onto another trace.
    """

    def __init__(self, app: ASGIApp, telemetry: Telemetry, routes: Sequence[BaseRoute]) -> None:
        self.app = app
        self._telemetry = telemetry
        self._routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        id_token = current_request_id.set(scope.get("state", {}).get("request_id"))
        try:
            if self._telemetry.is_tracing or log.isEnabledFor(logging.INFO):
                await self._observed(scope, receive, send)
            else:
                await self.app(scope, receive, send)
        finally:
            current_request_id.reset(id_token)

    async def _observed(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The request under its server span, then one access-log line (no bodies, no content)."""
        started_at = time.perf_counter()
        method: str = scope["method"]
        span = self._start_span(scope, method)
        token = otel_context.attach(trace.set_span_in_context(span))
        status_code = 500

        async def send_observed(message: Message) -> None:
            nonlocal status_code
            if message["type"] == "http.response.start":
                status_code = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_observed)
        except BaseException as exc:
            span.record_exception(exc)
            span.set_attribute("error.type", type(exc).__qualname__)
            span.set_status(Status(StatusCode.ERROR, type(exc).__qualname__))
            raise
        finally:
            route = self._route_of(scope)
            if span.is_recording():
                span.set_attribute("http.response.status_code", status_code)
                if route is not None:
                    span.set_attribute("http.route", route)
                    span.update_name(f"{method} {route}")
                if status_code >= 500:
                    span.set_attribute("error.type", str(status_code))
                    span.set_status(Status(StatusCode.ERROR))
            fields = {
                "method": method,
                "route": route,
                "status": status_code,
                "duration_ms": round((time.perf_counter() - started_at) * 1000, 3),
            }
            log.info("request finished", extra={"fields": fields})
            otel_context.detach(token)
            span.end()

    def _start_span(self, scope: Scope, method: str) -> trace.Span:
        if not self._telemetry.is_tracing:
            return trace.INVALID_SPAN
        attributes: dict[str, Any] = {
            "http.request.method": method,
            "url.path": scope["path"],
            "url.scheme": scope.get("scheme", "http"),
        }
        if (request_id := current_request_id.get()) is not None:
            attributes["edgeserve.request_id"] = request_id
        if server := scope.get("server"):
            attributes["server.address"] = server[0]
            if server[1] is not None:  # None on a Unix socket
                attributes["server.port"] = server[1]
        if client := scope.get("client"):
            attributes["client.address"] = client[0]
        links: list[Link] = []
        for name, value in scope["headers"]:
            if name == b"user-agent":
                attributes["user_agent.original"] = value.decode("latin-1")
            elif name == b"traceparent":
                given = PROPAGATOR.extract({"traceparent": value.decode("latin-1")})
                if (linked := trace.get_current_span(given).get_span_context()).is_valid:
                    links.append(Link(linked))
        return self._telemetry.tracer.start_span(
            method,
            context=otel_context.Context(),  # a new root: see the class docstring
            kind=SpanKind.SERVER,
            attributes=attributes,
            links=links,
        )

    def _route_of(self, scope: Scope) -> str | None:
        """The matched route's template (low cardinality, unlike the path)."""
        for route in self._routes:
            match, _ = route.matches(scope)
            if match is Match.FULL:
                return getattr(route, "path", None)
        return None


class GenAITracer:
    """Starts the GenAI span of each generation; one per gateway (it owns the admission counter)."""

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self._admission = AdmissionMetrics(telemetry.registry)

    def start(self, job: Job) -> GenAISpan:
        return GenAISpan(self.telemetry, self._admission, job)


class GenAISpan:
    """One generation as the gateway sees it: the span, its children and the metrics at its end.

    Not made current (it outlives the handler that opens it when the answer streams):
    children and the forwarded `traceparent` take their parent from `self.context`.
    """

    def __init__(self, telemetry: Telemetry, admission: AdmissionMetrics, job: Job) -> None:
        self._telemetry = telemetry
        self._admission = admission
        operation = job.operation_name
        model = job.model.name
        self._labels = GenAILabels(operation, PROVIDER_NAME, model, model)
        self._started_at = time.perf_counter()
        self._first_token_at: float | None = None
        self._output: list[str] | None = [] if telemetry.record_content else None
        self._is_ended = False
        attributes: dict[str, Any] = {}
        if telemetry.is_tracing:
            attributes = _request_attributes(job)
            if telemetry.record_content and isinstance(job, GenerationJob):
                attributes["gen_ai.input.messages"] = _input_messages(job.payload)
        self.span = telemetry.tracer.start_span(
            f"{operation} {model}", kind=SpanKind.CLIENT, attributes=attributes
        )
        self.context = trace.set_span_in_context(self.span)

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[trace.Span]:
        """A child span (admission, placement); an exception leaving it marks it failed."""
        with self._telemetry.tracer.start_as_current_span(name, context=self.context) as span:
            yield span

    def traceparent(self) -> dict[str, str]:
        """The W3C headers that make the node's span a child of this one (empty when off)."""
        carrier: dict[str, str] = {}
        PROPAGATOR.inject(carrier, context=self.context)
        return carrier

    def rejected(self, reason: str) -> None:
        """Admission refused the request (counted whether or not traces are on)."""
        self._admission.rejected(reason)
        self.span.set_attribute("edgeserve.admission.rejection_reason", reason)

    def placed(self, placement: Placement) -> None:
        if not self.span.is_recording():
            return
        url = urlsplit(placement.address)
        self.span.set_attributes(
            {
                "server.address": url.hostname or "",
                "server.port": url.port or (443 if url.scheme == "https" else 80),
                "edgeserve.node_id": placement.node_id,
            }
        )
        if placement.prefill_address is not None:  # disaggregated: the prompt runs there
            self.span.set_attribute("edgeserve.prefill_node.address", placement.prefill_address)

    def output(self, text: str, num_tokens: int) -> None:
        """A chunk of the answer arrived from the node."""
        if self._first_token_at is None and num_tokens > 0:
            self._first_token_at = time.perf_counter()
        if self._output is not None:
            self._output.append(text)

    def finish(
        self,
        *,
        finish_reason: str | None,
        num_input_tokens: int,
        num_output_tokens: int,
        num_cached_tokens: int,
        error_type: str | None,
    ) -> None:
        """The generation ended (finished, failed mid-stream or cancelled). Idempotent."""
        if self._is_ended:
            return
        self._is_ended = True
        now = time.perf_counter()
        first = self._first_token_at
        self._telemetry.genai.record(
            self._labels,
            duration_s=now - self._started_at,
            error_type=error_type,
            time_to_first_token_s=None if first is None else first - self._started_at,
            num_input_tokens=num_input_tokens,
            num_output_tokens=num_output_tokens,
            decode_time_s=None if first is None else now - first,
        )
        span = self.span
        if span.is_recording():
            attributes: dict[str, Any] = {
                "gen_ai.response.model": self._labels.response_model,
                "gen_ai.usage.input_tokens": num_input_tokens,
                "gen_ai.usage.output_tokens": num_output_tokens,
                "gen_ai.usage.cache_read.input_tokens": num_cached_tokens,
            }
            if finish_reason is not None:
                attributes["gen_ai.response.finish_reasons"] = (finish_reason,)
            if first is not None:
                attributes["gen_ai.response.time_to_first_chunk"] = first - self._started_at
            if self._output is not None:
                attributes["gen_ai.output.messages"] = _output_messages(
                    "".join(self._output), finish_reason
                )
            span.set_attributes(attributes)
            if error_type is not None:
                span.set_attribute("error.type", error_type)
                span.set_status(Status(StatusCode.ERROR, error_type))
        span.end()

    def fail(self, error: BaseException) -> None:
        """The generation never reached a node's first token (refused, no capacity, node errors)."""
        if self._is_ended:
            return
        self._is_ended = True
        error_type = type(error).__qualname__
        self._telemetry.genai.record(
            self._labels, duration_s=time.perf_counter() - self._started_at, error_type=error_type
        )
        self.span.set_attribute("error.type", error_type)
        detail = getattr(error, "detail", error)  # the trace may name the node; the client not
        self.span.set_status(Status(StatusCode.ERROR, f"{error_type}: {detail}"))
        self.span.end()


def _request_attributes(job: Job) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": job.operation_name,
        "gen_ai.provider.name": PROVIDER_NAME,
        "gen_ai.request.model": job.model.name,
        "gen_ai.response.id": job.request_id,
        "edgeserve.account_id": job.account_id,
        "edgeserve.request_id": job.request_id,
        "edgeserve.node_model": job.model.node_model,
    }
    if isinstance(job, EmbeddingJob):
        attributes["edgeserve.embeddings.inputs"] = job.num_inputs
        return attributes
    payload = job.payload
    attributes["gen_ai.request.max_tokens"] = payload.max_tokens
    attributes["gen_ai.request.stream"] = job.stream
    for key in ("temperature", "top_p", "top_k", "seed"):
        if key in payload.model_fields_set and (value := getattr(payload, key)) is not None:
            attributes[f"gen_ai.request.{key}"] = value
    return attributes


def _input_messages(payload: GenerateParams) -> str:
    """The convention's gen_ai.input.messages JSON (only when content recording is on)."""
    messages = payload.messages or [ChatMessage(role="user", content=payload.prompt or "")]
    return json.dumps(
        [{"role": m.role, "parts": [{"type": "text", "content": m.content}]} for m in messages],
        ensure_ascii=False,
    )


def _output_messages(text: str, finish_reason: str | None) -> str:
    message = {
        "role": "assistant",
        "parts": [{"type": "text", "content": text}],
        "finish_reason": finish_reason or "error",
    }
    return json.dumps([message], ensure_ascii=False)
