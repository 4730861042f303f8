"""Node telemetry: the node's span of each generation (continuing the gateway's trace) and
the engine's gauges and counters for Prometheus.

The span starts when the generate call arrives and ends with the request's last
output, whose `events` (queued, admitted, preempted, first_token, finished; each
with the KV pages the request held right after it) become span events at the
engine's own timestamps. The GenAI server histograms are recorded from the same
events, so on the node they measure the engine alone (queueing included, network
excluded); the gateway's measure what a client sees.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from common.node_api import GenerateRequest
from common.telemetry import PROPAGATOR, PROVIDER_NAME, GenAILabels, Telemetry
from common.telemetry.logs import current_log_span, current_request_id
from gpu_node.engine.outputs import EngineStats, RequestOutput

ENGINE_LABELS = ("node_id", "model", "kv_dtype")


class EngineCollector(Collector):
    """Reads the engine's stats at scrape time (nothing to keep in step on the hot path)."""

    def __init__(self, node_id: str, stats: Callable[[], EngineStats | None]) -> None:
        self._node_id = node_id
        self._stats = stats

    def describe(self) -> list[Metric]:
        return []  # the engine may still be loading when the collector is registered

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        if stats is None:
            return
        labels = [self._node_id, stats.model, stats.kv_dtype]
        gauges = (
            ("edgeserve_kv_pages_used", "KV cache pages held by sequences.",
             stats.num_pages - stats.num_free_pages),
            ("edgeserve_kv_pages_free", "KV cache pages free.", stats.num_free_pages),
            ("edgeserve_kv_pages", "KV cache pages in the pool.", stats.num_pages),
            ("edgeserve_sequences_running", "Sequences in the running batch.", stats.num_running),
            ("edgeserve_sequences_waiting", "Sequences waiting for pages.", stats.num_waiting),
        )  # fmt: skip
        for name, documentation, value in gauges:
            gauge = GaugeMetricFamily(name, documentation, labels=ENGINE_LABELS)
            gauge.add_metric(labels, value)
            yield gauge
        counters = (
            ("edgeserve_preemptions", "Sequences preempted (recomputed) for lack of KV pages.",
             stats.num_preemptions),
            ("edgeserve_integrity_violations",
             "Sequences aborted because a step touched a KV page they do not own.",
             stats.num_integrity_violations),
            ("edgeserve_tokens_computed",
             "Tokens the model ran: prompt chunks and decode steps.",
             stats.num_computed_tokens),
        )  # fmt: skip
        for name, documentation, value in counters:
            counter = CounterMetricFamily(name, documentation, labels=ENGINE_LABELS)
            counter.add_metric(labels, value)
            yield counter


class NodeTelemetry:
    """The node's telemetry: starts a `NodeSpan` per generation; exposes the engine's stats."""

    def __init__(
        self, telemetry: Telemetry, node_id: str, stats: Callable[[], EngineStats | None]
    ) -> None:
        self.telemetry = telemetry
        self.node_id = node_id
        self._stats = stats
        telemetry.registry.register(EngineCollector(node_id, stats))

    def start(
        self,
        headers: Mapping[str, str],
        body: GenerateRequest,
        num_prompt_tokens: int,
        started_ns: int,
        call: str = "generate",
    ) -> NodeSpan:
        """The span of one generation, a child of the gateway's span when `traceparent` says so.

        `call` "prefill": a prompt run for a decode node (disaggregation), named so and left
        out of the GenAI histograms (the decode node records the request)."""
        stats = self._stats()
        return NodeSpan(self, headers, body, num_prompt_tokens, started_ns, stats, call)


class NodeSpan:
    def __init__(
        self,
        owner: NodeTelemetry,
        headers: Mapping[str, str],
        body: GenerateRequest,
        num_prompt_tokens: int,
        started_ns: int,
        stats: EngineStats | None,
        call: str = "generate",
    ) -> None:
        telemetry = owner.telemetry
        self._telemetry = telemetry
        self._records_metrics = call == "generate"
        operation = "chat" if body.messages is not None else "text_completion"
        self._labels = GenAILabels(operation, PROVIDER_NAME, body.model, body.model)
        self._is_ended = False
        # For the log lines written while this request is served (the rest of its task).
        current_request_id.set(body.request_id)
        attributes: dict[str, Any] = {}
        if telemetry.is_tracing:
            attributes = {
                "gen_ai.operation.name": operation,
                "gen_ai.provider.name": PROVIDER_NAME,
                "gen_ai.request.model": body.model,
                "gen_ai.request.max_tokens": body.max_tokens,
                "gen_ai.request.temperature": body.temperature,
                "gen_ai.request.top_p": body.top_p,
                "gen_ai.request.top_k": body.top_k,
                "gen_ai.response.id": body.request_id,
                "edgeserve.request_id": body.request_id,
                "edgeserve.account_id": body.account_id,
                "edgeserve.node_id": owner.node_id,
                "edgeserve.prompt_tokens": num_prompt_tokens,
            }
            if body.seed is not None:
                attributes["gen_ai.request.seed"] = body.seed
            if stats is not None:
                attributes["edgeserve.kv_dtype"] = stats.kv_dtype
                attributes["edgeserve.kv_page_size"] = stats.page_size
        parent = PROPAGATOR.extract(headers)
        self.span = telemetry.tracer.start_span(
            f"{call} {body.model}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes=attributes,
            start_time=started_ns,
        )
        # Named by the log lines of the rest of the request's task, as its request id is.
        current_log_span.set(self.span)

    def finish(self, out: RequestOutput) -> None:
        """The request's last output: its events, usage and the engine-side GenAI metrics."""
        if self._is_ended:
            return
        self._is_ended = True
        times = {event.name: event.time_ns for event in out.events}
        error_type = "engine_error" if out.finish_reason == "error" else None
        queued, first, done = times.get("queued"), times.get("first_token"), times.get("finished")
        if queued is not None and done is not None and self._records_metrics:
            self._telemetry.genai.record(
                self._labels,
                duration_s=(done - queued) / 1e9,
                error_type=error_type,
                time_to_first_token_s=None if first is None else (first - queued) / 1e9,
                num_input_tokens=out.num_prompt_tokens,
                num_output_tokens=out.num_completion_tokens,
                decode_time_s=None if first is None else (done - first) / 1e9,
            )
        span = self.span
        if span.is_recording():
            for event in out.events:
                span.add_event(
                    event.name, {"edgeserve.kv_pages": event.num_pages}, timestamp=event.time_ns
                )
            span.set_attributes(
                {
                    "gen_ai.response.model": self._labels.response_model,
                    "gen_ai.response.finish_reasons": (out.finish_reason or "error",),
                    "gen_ai.usage.input_tokens": out.num_prompt_tokens,
                    "gen_ai.usage.output_tokens": out.num_completion_tokens,
                    "gen_ai.usage.cache_read.input_tokens": out.num_cached_tokens,
                    "edgeserve.kv_pages": max((e.num_pages for e in out.events), default=0),
                    "edgeserve.num_preemptions": sum(e.name == "preempted" for e in out.events),
                }
            )
            if error_type is not None:
                span.set_attribute("error.type", error_type)
                span.set_status(Status(StatusCode.ERROR, out.error or error_type))
        span.end()

    def traceparent(self) -> dict[str, str]:
        """The W3C headers that make a call this span makes (a KV fetch) its child."""
        carrier: dict[str, str] = {}
        PROPAGATOR.inject(carrier, context=set_span_in_context(self.span))
        return carrier

    def fail(self, error_type: str, message: str = "") -> None:
        """The request ended without a last output (refused, aborted, stream broken)."""
        if self._is_ended:
            return
        self._is_ended = True
        self.span.set_attribute("error.type", error_type)
        self.span.set_status(Status(StatusCode.ERROR, message or error_type))
        self.span.end()
