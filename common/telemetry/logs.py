"""Structured logs: one JSON line per event, with the trace id, span id and request id.

The request id travels in a context variable set where a request enters the process
(the gateway's server-span middleware, the node's span), so every log line written
while serving it carries the id without threading it through every call.
"""

from __future__ import annotations

import json
import logging
import sys
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import IO, Any

from opentelemetry import trace

from common.telemetry.settings import TelemetrySettings

current_request_id: ContextVar[str | None] = ContextVar("edgeserve_request_id", default=None)
# The span a task's log lines name when none is current: the node's, which serves a request
# over several tasks and is never made current (it would parent every later span there).
current_log_span: ContextVar[trace.Span | None] = ContextVar("edgeserve_log_span", default=None)


class JsonLogFormatter(logging.Formatter):
    """`{"time", "level", "logger", "message", "request_id", "trace_id", "span_id", ...}`.

    Fields passed as `extra={"fields": {...}}` are merged in; never pass prompt or
    completion text (nothing in edgeserve does).
    """

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None) or current_request_id.get()
        if request_id is not None:
            entry["request_id"] = request_id
        span_context = trace.get_current_span().get_span_context()
        if not span_context.is_valid and (span := current_log_span.get()) is not None:
            span_context = span.get_span_context()
        if span_context.is_valid:
            entry["trace_id"] = format(span_context.trace_id, "032x")
            entry["span_id"] = format(span_context.span_id, "016x")
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


class JsonLogHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A stream handler with the JSON formatter; its class marks it as ours to replace."""

    def __init__(self, stream: IO[str] | None = None) -> None:
        super().__init__(stream if stream is not None else sys.stderr)
        self.setFormatter(JsonLogFormatter())


def configure_logging(
    settings: TelemetrySettings, stream: IO[str] | None = None
) -> logging.Handler:
    """Route the root logger to one JSON handler (replacing one installed before)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, JsonLogHandler):
            root.removeHandler(handler)
    handler = JsonLogHandler(stream)
    root.addHandler(handler)
    root.setLevel(settings.log_level)
    # httpx logs every request it sends at INFO: one line per forward would double the
    # access log. Its warnings and errors still come through.
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))
    return handler
