"""The GenAI semantic conventions' metrics, exposed the Prometheus way with prometheus-client.

OTel names translate to Prometheus as the OTel Prometheus exporter does: dots become
underscores and the unit is appended (`gen_ai.server.time_to_first_token` in `s` ->
`gen_ai_server_time_to_first_token_seconds`; `{token}` is an annotation and adds
nothing), attribute keys become labels the same way (`gen_ai.token.type` ->
`gen_ai_token_type`). Bucket boundaries are the conventions' explicit ones, so
dashboards built for any other GenAI server read ours.

Each process keeps its own `CollectorRegistry` (no global one), so a gateway and a
node can share a process (`edgeserve up`, tests) without their series colliding.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram

# The conventions' explicit bucket boundaries (semconv GenAI metrics).
TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip
TIME_PER_OUTPUT_TOKEN_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
REQUEST_DURATION_BUCKETS = (
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
)  # fmt: skip
TOKEN_USAGE_BUCKETS = (
    1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864,
)  # fmt: skip

GENAI_LABELS = (
    "gen_ai_operation_name",
    "gen_ai_provider_name",
    "gen_ai_request_model",
    "gen_ai_response_model",
)


@dataclass(frozen=True, slots=True)
class GenAILabels:
    """The attributes every GenAI metric carries, in GENAI_LABELS order."""

    operation_name: str  # chat | text_completion
    provider_name: str
    request_model: str
    response_model: str

    def values(self) -> tuple[str, str, str, str]:
        return (self.operation_name, self.provider_name, self.request_model, self.response_model)


class GenAIMetrics:
    """The four GenAI histograms on one registry, recorded once per request."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.time_to_first_token = Histogram(
            "gen_ai_server_time_to_first_token",
            "Time to generate first token for successful responses.",
            GENAI_LABELS,
            unit="seconds",
            registry=registry,
            buckets=TIME_TO_FIRST_TOKEN_BUCKETS,
        )
        self.time_per_output_token = Histogram(
            "gen_ai_server_time_per_output_token",
            "Time per output token generated after the first token for successful responses.",
            GENAI_LABELS,
            unit="seconds",
            registry=registry,
            buckets=TIME_PER_OUTPUT_TOKEN_BUCKETS,
        )
        self.request_duration = Histogram(
            "gen_ai_server_request_duration",
            "Generative AI server request duration such as time-to-last byte or last output token.",
            (*GENAI_LABELS, "error_type"),
            unit="seconds",
            registry=registry,
            buckets=REQUEST_DURATION_BUCKETS,
        )
        self.token_usage = Histogram(
            "gen_ai_client_token_usage",
            "Number of input and output tokens used.",
            (*GENAI_LABELS, "gen_ai_token_type"),
            registry=registry,
            buckets=TOKEN_USAGE_BUCKETS,
        )

    def record(
        self,
        labels: GenAILabels,
        *,
        duration_s: float,
        error_type: str | None,
        time_to_first_token_s: float | None = None,
        num_input_tokens: int | None = None,
        num_output_tokens: int | None = None,
        decode_time_s: float | None = None,  # first token -> last token
    ) -> None:
        """One finished request. Latencies after the first token count for successful ones only."""
        values = labels.values()
        self.request_duration.labels(*values, error_type or "").observe(duration_s)
        if num_input_tokens is not None:
            self.token_usage.labels(*values, "input").observe(num_input_tokens)
        if num_output_tokens is not None:
            self.token_usage.labels(*values, "output").observe(num_output_tokens)
        if error_type is not None:
            return
        if time_to_first_token_s is not None:
            self.time_to_first_token.labels(*values).observe(time_to_first_token_s)
        if decode_time_s is not None and num_output_tokens is not None and num_output_tokens > 1:
            self.time_per_output_token.labels(*values).observe(
                decode_time_s / (num_output_tokens - 1)
            )


class AdmissionMetrics:
    """Requests the gateway refused before placing them, by reason."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.rejections = Counter(
            "edgeserve_admission_rejections",
            "Requests refused by admission control, by reason.",
            ("reason",),  # requests | tokens | concurrency | too_large | unavailable | no_capacity
            registry=registry,
        )

    def rejected(self, reason: str) -> None:
        self.rejections.labels(reason).inc()
