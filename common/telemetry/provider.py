"""`setup_telemetry(settings)`: the tracer (sampled, exported over OTLP/HTTP) and the metrics registry.

Nothing here is global: no process-wide tracer provider or Prometheus registry is
set, so a gateway and a node in one process (`edgeserve up`, tests) each keep their
own service name, spans and series. Callers pass the `Telemetry` down explicitly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from common.telemetry.metrics import GenAIMetrics
from common.telemetry.settings import TelemetrySettings

INSTRUMENTATION_NAME = "edgeserve"
PROVIDER_NAME = "edgeserve"  # gen_ai.provider.name of every GenAI span and metric we emit

# W3C trace context (traceparent/tracestate) only: stateless, so one instance serves all.
PROPAGATOR = TraceContextTextMapPropagator()


@dataclass(frozen=True)
class Telemetry:
    """One process role's telemetry: its tracer, its Prometheus registry and GenAI histograms."""

    settings: TelemetrySettings
    tracer: trace.Tracer
    registry: CollectorRegistry
    genai: GenAIMetrics
    provider: TracerProvider | None = None  # None when tracing is off

    @property
    def is_tracing(self) -> bool:
        return self.provider is not None

    @property
    def record_content(self) -> bool:
        return self.settings.record_content

    def render_metrics(self) -> tuple[bytes, str]:
        """`GET /metrics`: the registry in Prometheus text format, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def force_flush(self, timeout_ms: int = 5000) -> bool:
        return self.provider is None or self.provider.force_flush(timeout_ms)

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()


def setup_telemetry(
    settings: TelemetrySettings, *, span_processors: Sequence[SpanProcessor] = ()
) -> Telemetry:
    """Build the telemetry of one process role; `span_processors` add sinks (tests, benchmarks)."""
    registry = CollectorRegistry(auto_describe=True)
    genai = GenAIMetrics(registry)
    if not settings.is_tracing:
        return Telemetry(settings, trace.NoOpTracer(), registry, genai)
    provider = TracerProvider(
        resource=Resource.create({"service.name": settings.service_name}),
        # A node samples what the gateway sampled; the ratio decides for new traces only.
        sampler=ParentBased(TraceIdRatioBased(settings.sampling_ratio)),
    )
    if settings.otlp_traces_endpoint is not None:
        # Imported here: the exporter pulls in protobuf and requests, needed only when used.
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.otlp_traces_endpoint))
        )
    for processor in span_processors:
        provider.add_span_processor(processor)
    tracer = provider.get_tracer(INSTRUMENTATION_NAME)
    return Telemetry(settings, tracer, registry, genai, provider)
