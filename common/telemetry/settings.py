"""Telemetry settings: one frozen object, read from the environment once at the entry point."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})
_LOG_LEVELS = frozenset({"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"})


class TelemetrySettingsError(ValueError):
    """A telemetry setting is out of range or unreadable; the message names the field."""


@dataclass(frozen=True)
class TelemetrySettings:
    service_name: str  # the OTel resource's service.name: edgeserve-gateway, edgeserve-node
    is_tracing: bool = True  # False: spans are no-ops (metrics and logs stay)
    sampling_ratio: float = 1.0  # of root traces; a node follows the gateway's decision
    otlp_traces_endpoint: str | None = None  # full URL of an OTLP/HTTP receiver's /v1/traces
    record_content: bool = False  # prompt and completion text on spans: off unless asked for
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if not self.service_name:
            raise TelemetrySettingsError("service_name must not be empty")
        if not 0.0 <= self.sampling_ratio <= 1.0:
            raise TelemetrySettingsError(
                f"sampling_ratio must be within [0, 1], got {self.sampling_ratio}"
            )
        if self.otlp_traces_endpoint is not None and not self.otlp_traces_endpoint.startswith(
            ("http://", "https://")
        ):
            raise TelemetrySettingsError(
                f"otlp_traces_endpoint must be an http(s) URL, got {self.otlp_traces_endpoint!r}"
            )
        if self.log_level not in _LOG_LEVELS:
            raise TelemetrySettingsError(
                f"log_level must be one of {sorted(_LOG_LEVELS)}, got {self.log_level!r}"
            )

    @classmethod
    def from_env(
        cls, service_name: str, environ: Mapping[str, str] | None = None
    ) -> TelemetrySettings:
        """The standard OTel variables plus ours:

        OTEL_SERVICE_NAME, OTEL_SDK_DISABLED, OTEL_TRACES_SAMPLER_ARG (the ratio),
        OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (used as is) or OTEL_EXPORTER_OTLP_ENDPOINT
        (+ /v1/traces), EDGESERVE_RECORD_CONTENT, EDGESERVE_LOG_LEVEL.
        """
        env = os.environ if environ is None else environ
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or None
        if endpoint is None and (base := env.get("OTEL_EXPORTER_OTLP_ENDPOINT")):
            endpoint = base.rstrip("/") + "/v1/traces"
        return cls(
            service_name=env.get("OTEL_SERVICE_NAME") or service_name,
            is_tracing=not _flag(env, "OTEL_SDK_DISABLED", default=False),
            sampling_ratio=_ratio(env, "OTEL_TRACES_SAMPLER_ARG"),
            otlp_traces_endpoint=endpoint,
            record_content=_flag(env, "EDGESERVE_RECORD_CONTENT", default=False),
            log_level=env.get("EDGESERVE_LOG_LEVEL", "INFO").upper(),
        )


def _flag(env: Mapping[str, str], name: str, *, default: bool) -> bool:
    raw = env.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise TelemetrySettingsError(f"{name} must be true or false, got {raw!r}")


def _ratio(env: Mapping[str, str], name: str) -> float:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return 1.0
    try:
        return float(raw)
    except ValueError:
        raise TelemetrySettingsError(f"{name} must be a number in [0, 1], got {raw!r}") from None
