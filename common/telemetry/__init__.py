"""Telemetry shared by the gateway and the node: traces, GenAI metrics, JSON logs.

settings   TelemetrySettings (from the environment, validated once)
provider   setup_telemetry -> Telemetry (tracer, Prometheus registry, GenAI histograms)
metrics    the GenAI conventions' histograms and bucket boundaries; admission counters
logs       one JSON line per event with trace id and request id
"""

from common.telemetry.logs import (
    JsonLogFormatter,
    JsonLogHandler,
    configure_logging,
    current_request_id,
)
from common.telemetry.metrics import (
    REQUEST_DURATION_BUCKETS,
    TIME_PER_OUTPUT_TOKEN_BUCKETS,
    TIME_TO_FIRST_TOKEN_BUCKETS,
    TOKEN_USAGE_BUCKETS,
    AdmissionMetrics,
    GenAILabels,
    GenAIMetrics,
)
from common.telemetry.provider import (
    PROPAGATOR,
    PROVIDER_NAME,
    Telemetry,
    setup_telemetry,
)
from common.telemetry.settings import TelemetrySettings, TelemetrySettingsError

__all__ = [
    "PROPAGATOR",
    "PROVIDER_NAME",
    "REQUEST_DURATION_BUCKETS",
    "TIME_PER_OUTPUT_TOKEN_BUCKETS",
    "TIME_TO_FIRST_TOKEN_BUCKETS",
    "TOKEN_USAGE_BUCKETS",
    "AdmissionMetrics",
    "GenAILabels",
    "GenAIMetrics",
    "JsonLogFormatter",
    "JsonLogHandler",
    "Telemetry",
    "TelemetrySettings",
    "TelemetrySettingsError",
    "configure_logging",
    "current_request_id",
    "setup_telemetry",
]
