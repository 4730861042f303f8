"""Telemetry pieces on their own: settings, JSON logs, GenAI histograms, engine collector, spans."""

from __future__ import annotations

import io
import json
import logging

import httpx
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from common.node_api import GenerateRequest
from common.telemetry import (
    PROPAGATOR,
    REQUEST_DURATION_BUCKETS,
    TIME_PER_OUTPUT_TOKEN_BUCKETS,
    TIME_TO_FIRST_TOKEN_BUCKETS,
    TOKEN_USAGE_BUCKETS,
    GenAILabels,
    JsonLogFormatter,
    TelemetrySettings,
    TelemetrySettingsError,
    current_request_id,
    setup_telemetry,
)
from gateway.middleware import RequestIdMiddleware
from gateway.tracing import TracingMiddleware
from gpu_node.engine.outputs import EngineEvent, EngineStats, RequestOutput
from gpu_node.telemetry import NodeTelemetry


def traced(
    service: str = "test", record_content: bool = False
) -> tuple[InMemorySpanExporter, object]:
    exporter = InMemorySpanExporter()
    telemetry = setup_telemetry(
        TelemetrySettings(service, record_content=record_content),
        span_processors=[SimpleSpanProcessor(exporter)],
    )
    return exporter, telemetry


# -- settings ----------------------------------------------------------------------------


def test_settings_from_env_reads_the_standard_variables() -> None:
    settings = TelemetrySettings.from_env(
        "edgeserve-gateway",
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/",
            "OTEL_TRACES_SAMPLER_ARG": "0.25",
            "EDGESERVE_RECORD_CONTENT": "true",
            "EDGESERVE_LOG_LEVEL": "debug",
        },
    )
    assert settings == TelemetrySettings(
        service_name="edgeserve-gateway",
        is_tracing=True,
        sampling_ratio=0.25,
        otlp_traces_endpoint="http://collector:4318/v1/traces",
        record_content=True,
        log_level="DEBUG",
    )


def test_settings_defaults_record_no_content_and_export_nowhere() -> None:
    settings = TelemetrySettings.from_env("edgeserve-node", {})
    assert settings == TelemetrySettings("edgeserve-node")
    assert settings.record_content is False
    assert settings.otlp_traces_endpoint is None
    assert settings.sampling_ratio == 1.0


def test_settings_traces_endpoint_wins_and_sdk_can_be_disabled() -> None:
    settings = TelemetrySettings.from_env(
        "gw",
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:4318",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://b:4318/traces",
            "OTEL_SDK_DISABLED": "1",
            "OTEL_SERVICE_NAME": "edge-1",
        },
    )
    assert settings.otlp_traces_endpoint == "http://b:4318/traces"
    assert settings.is_tracing is False
    assert settings.service_name == "edge-1"
    assert setup_telemetry(settings).is_tracing is False


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"OTEL_TRACES_SAMPLER_ARG": "1.5"}, "sampling_ratio must be within [0, 1], got 1.5"),
        ({"OTEL_TRACES_SAMPLER_ARG": "half"}, "OTEL_TRACES_SAMPLER_ARG must be a number"),
        ({"EDGESERVE_RECORD_CONTENT": "maybe"}, "EDGESERVE_RECORD_CONTENT must be true or false"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4318"}, "must be an http(s) URL"),
        ({"EDGESERVE_LOG_LEVEL": "loud"}, "log_level must be one of"),
    ],
)
def test_bad_settings_are_typed_errors_naming_the_field(env: dict[str, str], message: str) -> None:
    with pytest.raises(TelemetrySettingsError) as info:
        TelemetrySettings.from_env("gw", env)
    assert message in str(info.value)


# -- JSON logs ---------------------------------------------------------------------------


def test_json_log_line_carries_trace_span_and_request_id() -> None:
    _, telemetry = traced()
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonLogFormatter())
    logger = logging.getLogger("test.telemetry.json")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    token = current_request_id.set("req-123")
    try:
        with telemetry.tracer.start_as_current_span("work") as span:
            logger.info("placed on %s", "node-1", extra={"fields": {"node_id": "node-1"}})
        logger.warning("outside")
    finally:
        current_request_id.reset(token)
        logger.removeHandler(handler)
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    context = span.get_span_context()
    assert {k: v for k, v in first.items() if k != "time"} == {
        "level": "INFO",
        "logger": "test.telemetry.json",
        "message": "placed on node-1",
        "request_id": "req-123",
        "trace_id": format(context.trace_id, "032x"),
        "span_id": format(context.span_id, "016x"),
        "node_id": "node-1",
    }
    assert first["time"].endswith("+00:00")
    assert {k: v for k, v in second.items() if k != "time"} == {
        "level": "WARNING",
        "logger": "test.telemetry.json",
        "message": "outside",
        "request_id": "req-123",
    }


# -- GenAI histograms --------------------------------------------------------------------


def key(*pairs: tuple[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(pairs))


def buckets_of(
    text: str, name: str
) -> dict[tuple[tuple[str, str], ...], list[tuple[float, float]]]:
    """Per label set (le excluded): [(upper bound, cumulative count)] of one histogram."""
    out: dict[tuple[tuple[str, str], ...], list[tuple[float, float]]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        for sample in family.samples:
            if sample.name == f"{name}_bucket":
                key = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
                out.setdefault(key, []).append((float(sample.labels["le"]), sample.value))
    return out


def test_genai_histograms_have_the_conventions_names_buckets_and_values() -> None:
    _, telemetry = traced()
    labels = GenAILabels("chat", "edgeserve", "@cf/m", "@cf/m")
    telemetry.genai.record(
        labels,
        duration_s=0.5,
        error_type=None,
        time_to_first_token_s=0.03,
        num_input_tokens=20,
        num_output_tokens=5,
        decode_time_s=0.4,  # 4 gaps after the first token: 0.1 s per output token
    )
    telemetry.genai.record(labels, duration_s=0.015, error_type="RateLimitedError")
    text = generate_latest(telemetry.registry).decode()
    base = (
        ("gen_ai_operation_name", "chat"),
        ("gen_ai_provider_name", "edgeserve"),
        ("gen_ai_request_model", "@cf/m"),
        ("gen_ai_response_model", "@cf/m"),
    )
    ttft = buckets_of(text, "gen_ai_server_time_to_first_token_seconds")
    assert [le for le, _ in ttft[base]] == [*TIME_TO_FIRST_TOKEN_BUCKETS, float("inf")]
    assert [count for _, count in ttft[base]] == [0, 0, 0, 0, *[1] * 13]
    tpot = buckets_of(text, "gen_ai_server_time_per_output_token_seconds")
    assert [le for le, _ in tpot[base]] == [*TIME_PER_OUTPUT_TOKEN_BUCKETS, float("inf")]
    assert [count for _, count in tpot[base]] == [0, 0, 0, 0, *[1] * 10]  # 0.1 <= le 0.1
    duration = buckets_of(text, "gen_ai_server_request_duration_seconds")
    assert sorted(duration) == sorted(
        [key(*base, ("error_type", "")), key(*base, ("error_type", "RateLimitedError"))]
    )
    assert [le for le, _ in duration[key(*base, ("error_type", ""))]] == [
        *REQUEST_DURATION_BUCKETS,
        float("inf"),
    ]
    assert [c for _, c in duration[key(*base, ("error_type", "RateLimitedError"))]][:2] == [0, 1]
    usage = buckets_of(text, "gen_ai_client_token_usage")
    keys = sorted(usage)
    assert keys == sorted(
        [key(*base, ("gen_ai_token_type", "input")), key(*base, ("gen_ai_token_type", "output"))]
    )
    input_buckets = usage[key(*base, ("gen_ai_token_type", "input"))]
    assert [le for le, _ in input_buckets] == [*map(float, TOKEN_USAGE_BUCKETS), float("inf")]
    assert [c for _, c in input_buckets][:4] == [0, 0, 0, 1]  # 20 tokens: first in le=64


# -- engine collector and node span ------------------------------------------------------

STATS = EngineStats(
    model="smollm2",
    kv_dtype="fp8",
    page_size=16,
    num_pages=100,
    num_free_pages=70,
    num_running=3,
    num_waiting=2,
    max_model_len=1024,
    activations="bf16",
    num_preemptions=4,
    num_integrity_violations=1,
    num_computed_tokens=12345,
)


def test_engine_collector_reports_the_stats_at_scrape_time() -> None:
    _, telemetry = traced()
    current: list[EngineStats | None] = [None]
    NodeTelemetry(telemetry, "node-7", lambda: current[0])
    assert "edgeserve_kv_pages" not in generate_latest(telemetry.registry).decode()  # loading
    current[0] = STATS
    values = {
        sample.name: (sample.labels, sample.value)
        for family in text_string_to_metric_families(generate_latest(telemetry.registry).decode())
        for sample in family.samples
        if sample.name.startswith("edgeserve_")
    }
    labels = {"node_id": "node-7", "model": "smollm2", "kv_dtype": "fp8"}
    assert values == {
        "edgeserve_kv_pages_used": (labels, 30.0),
        "edgeserve_kv_pages_free": (labels, 70.0),
        "edgeserve_kv_pages": (labels, 100.0),
        "edgeserve_sequences_running": (labels, 3.0),
        "edgeserve_sequences_waiting": (labels, 2.0),
        "edgeserve_preemptions_total": (labels, 4.0),
        "edgeserve_integrity_violations_total": (labels, 1.0),
        "edgeserve_tokens_computed_total": (labels, 12345.0),
    }


def test_node_span_continues_the_traceparent_and_carries_engine_events() -> None:
    exporter, telemetry = traced("node")
    node = NodeTelemetry(telemetry, "node-7", lambda: STATS)
    with telemetry.tracer.start_as_current_span("gateway-genai") as parent:
        headers: dict[str, str] = {}
        PROPAGATOR.inject(headers)
    body = GenerateRequest(
        request_id="r-1", account_id="acct", model="smollm2", prompt="hi", max_tokens=3, seed=7
    )
    span = node.start(headers, body, num_prompt_tokens=9, started_ns=1_000)
    t0 = 2_000_000_000
    events = (
        EngineEvent("queued", t0, 0),
        EngineEvent("admitted", t0 + 1_000_000, 1),
        EngineEvent("first_token", t0 + 21_000_000, 1),
        EngineEvent("preempted", t0 + 31_000_000, 0),
        EngineEvent("admitted", t0 + 41_000_000, 2),
        EngineEvent("finished", t0 + 61_000_000, 2),
    )
    span.finish(RequestOutput("r-1", (5,), "x", True, "length", 9, 3, 0, None, events))
    span.finish(RequestOutput("r-1", (5,), "x", True, "length", 9, 3, 0, None, events))  # once
    node_span = next(s for s in exporter.get_finished_spans() if s.name == "generate smollm2")
    assert node_span.kind is SpanKind.SERVER
    assert node_span.parent is not None
    assert node_span.parent.span_id == parent.get_span_context().span_id
    assert node_span.context.trace_id == parent.get_span_context().trace_id
    assert node_span.start_time == 1_000
    assert [(e.name, e.timestamp, dict(e.attributes or {})) for e in node_span.events] == [
        (e.name, e.time_ns, {"edgeserve.kv_pages": e.num_pages}) for e in events
    ]
    attributes = dict(node_span.attributes or {})
    assert attributes == {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.provider.name": "edgeserve",
        "gen_ai.request.model": "smollm2",
        "gen_ai.request.max_tokens": 3,
        "gen_ai.request.temperature": 0.0,
        "gen_ai.request.top_p": 1.0,
        "gen_ai.request.top_k": 0,
        "gen_ai.request.seed": 7,
        "gen_ai.response.id": "r-1",
        "gen_ai.response.model": "smollm2",
        "gen_ai.response.finish_reasons": ("length",),
        "gen_ai.usage.input_tokens": 9,
        "gen_ai.usage.output_tokens": 3,
        "gen_ai.usage.cache_read.input_tokens": 0,
        "edgeserve.request_id": "r-1",
        "edgeserve.account_id": "acct",
        "edgeserve.node_id": "node-7",
        "edgeserve.prompt_tokens": 9,
        "edgeserve.kv_dtype": "fp8",
        "edgeserve.kv_page_size": 16,
        "edgeserve.kv_pages": 2,
        "edgeserve.num_preemptions": 1,
    }
    text = generate_latest(telemetry.registry).decode()
    ttft = buckets_of(text, "gen_ai_server_time_to_first_token_seconds")
    (counts,) = ttft.values()
    assert [c for _, c in counts][:6] == [0, 0, 0, 0, 1, 1]  # 21 ms: first in le=0.04


# -- the server span middleware ----------------------------------------------------------


async def test_server_span_names_the_route_and_links_a_client_traceparent() -> None:
    exporter, telemetry = traced("gateway")

    async def item(request: Request) -> Response:
        return PlainTextResponse(
            "ok" if request.path_params["id"] != "boom" else "no",
            200 if request.path_params["id"] != "boom" else 503,
        )

    inner = Starlette(routes=[Route("/items/{id}", item)])
    app = RequestIdMiddleware(TracingMiddleware(inner, telemetry, inner.routes))
    stream = io.StringIO()
    access_log = logging.getLogger("gateway.tracing")
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonLogFormatter())
    access_log.addHandler(handler)
    access_log.setLevel(logging.INFO)
    client_trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://gw"
    ) as client:
        ok = await client.get(
            "/items/42", headers={"traceparent": client_trace, "user-agent": "t/1"}
        )
        failed = await client.get("/items/boom")
    first, second = exporter.get_finished_spans()
    assert first.name == "GET /items/{id}"
    assert first.kind is SpanKind.SERVER
    assert first.parent is None  # a new root: the client's trace is a link
    assert [format(link.context.trace_id, "032x") for link in first.links] == [
        "0af7651916cd43dd8448eb211c80319c"
    ]
    assert dict(first.attributes or {}) == {
        "http.request.method": "GET",
        "url.path": "/items/42",
        "url.scheme": "http",
        "server.address": "gw",  # no server.port: the in-process transport has none
        "client.address": "127.0.0.1",
        "user_agent.original": "t/1",
        "edgeserve.request_id": ok.headers["x-request-id"],
        "http.response.status_code": 200,
        "http.route": "/items/{id}",
    }
    assert second.attributes is not None
    assert second.attributes["http.response.status_code"] == 503
    assert second.attributes["error.type"] == "503"
    assert second.attributes["edgeserve.request_id"] == failed.headers["x-request-id"]
    assert second.status.is_ok is False
    access_log.removeHandler(handler)
    access_log.setLevel(logging.NOTSET)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [
        {k: v for k, v in line.items() if k not in ("time", "duration_ms")} for line in lines
    ] == [
        {
            "level": "INFO",
            "logger": "gateway.tracing",
            "message": "request finished",
            "request_id": response.headers["x-request-id"],
            "trace_id": format(span.context.trace_id, "032x"),
            "span_id": format(span.context.span_id, "016x"),
            "method": "GET",
            "route": "/items/{id}",
            "status": status,
        }
        for response, span, status in ((ok, first, 200), (failed, second, 503))
    ]
    assert all(line["duration_ms"] >= 0 for line in lines)


# -- sampling and the GenAI span on its own ----------------------------------------------


def test_a_node_follows_the_gateways_sampling_decision() -> None:
    gateway_spans, node_spans = InMemorySpanExporter(), InMemorySpanExporter()
    gateway = setup_telemetry(
        TelemetrySettings("gw", sampling_ratio=0.0),
        span_processors=[SimpleSpanProcessor(gateway_spans)],
    )
    node = NodeTelemetry(
        setup_telemetry(
            TelemetrySettings("node", sampling_ratio=1.0),
            span_processors=[SimpleSpanProcessor(node_spans)],
        ),
        "node-7",
        lambda: STATS,
    )
    with gateway.tracer.start_as_current_span("unsampled") as parent:
        headers: dict[str, str] = {}
        PROPAGATOR.inject(headers)
    assert int(headers["traceparent"].rsplit("-", 1)[1], 16) & 1 == 0  # propagated, not sampled
    body = GenerateRequest(request_id="r-2", model="smollm2", prompt="hi", max_tokens=1)
    span = node.start(headers, body, num_prompt_tokens=3, started_ns=1)
    assert span.span.is_recording() is False
    assert span.span.get_span_context().trace_id == parent.get_span_context().trace_id
    events = (
        EngineEvent("queued", 10, 0),
        EngineEvent("first_token", 20, 1),
        EngineEvent("finished", 30, 1),
    )
    span.finish(RequestOutput("r-2", (1,), "a", True, "length", 3, 1, 0, None, events))
    assert gateway_spans.get_finished_spans() == () and node_spans.get_finished_spans() == ()
    text = generate_latest(node.telemetry.registry).decode()
    (counts,) = buckets_of(text, "gen_ai_server_time_to_first_token_seconds").values()
    assert counts[0] == (0.001, 1.0)  # metrics are recorded whether or not the trace is sampled


def job(payload: dict[str, object], stream: bool = True) -> object:
    from common.node_api import GenerateParams
    from gateway.catalog import DEFAULT_MODELS
    from gateway.dispatch import GenerationJob

    params = GenerateParams.model_validate(payload)
    return GenerationJob("req-9", "acct-9", DEFAULT_MODELS[0], params, 64, stream=stream)


def test_genai_span_records_content_only_when_asked_and_errors_by_type() -> None:
    from gateway.tracing import GenAITracer
    from scheduler.placement import Placement

    for record_content in (False, True):
        exporter, telemetry = traced(record_content=record_content)
        tracer = GenAITracer(telemetry)
        payload = {"messages": [{"role": "user", "content": "secret"}], "max_tokens": 4}
        span = tracer.start(job(payload))  # type: ignore[arg-type]
        with span.step("placement"):
            pass
        span.placed(Placement("req-9", "node-3", "http://10.0.0.7:8081", 64))
        span.output("", 0)
        span.output("Hel", 1)
        span.output("lo", 1)
        span.finish(
            finish_reason=None,
            num_input_tokens=12,
            num_output_tokens=2,
            num_cached_tokens=0,
            error_type="UpstreamError",
        )
        span.finish(  # idempotent: the first end stands
            finish_reason="stop",
            num_input_tokens=0,
            num_output_tokens=0,
            num_cached_tokens=0,
            error_type=None,
        )
        placement, genai = exporter.get_finished_spans()
        assert placement.parent is not None and placement.parent.span_id == genai.context.span_id
        attributes = dict(genai.attributes or {})
        assert attributes.pop("gen_ai.response.time_to_first_chunk") > 0
        content = {
            "gen_ai.input.messages": json.dumps(
                [{"role": "user", "parts": [{"type": "text", "content": "secret"}]}]
            ),
            "gen_ai.output.messages": json.dumps(
                [
                    {
                        "role": "assistant",
                        "parts": [{"type": "text", "content": "Hello"}],
                        "finish_reason": "error",
                    }
                ]
            ),
        }
        assert attributes == {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": "edgeserve",
            "gen_ai.request.model": "@cf/huggingface/smollm2-135m-instruct",
            "gen_ai.request.max_tokens": 4,
            "gen_ai.request.stream": True,
            "gen_ai.response.id": "req-9",
            "gen_ai.response.model": "@cf/huggingface/smollm2-135m-instruct",
            "gen_ai.usage.input_tokens": 12,
            "gen_ai.usage.output_tokens": 2,
            "gen_ai.usage.cache_read.input_tokens": 0,
            "server.address": "10.0.0.7",
            "server.port": 8081,
            "edgeserve.account_id": "acct-9",
            "edgeserve.request_id": "req-9",
            "edgeserve.node_model": "smollm2",
            "edgeserve.node_id": "node-3",
            "error.type": "UpstreamError",
        } | (content if record_content else {})
        assert genai.status.is_ok is False


def test_a_disaggregated_placement_names_its_prefill_node() -> None:
    from gateway.tracing import GenAITracer
    from scheduler.placement import Placement

    exporter, telemetry = traced(record_content=False)
    span = GenAITracer(telemetry).start(job({"prompt": "Hi", "max_tokens": 4}))  # type: ignore[arg-type]
    span.placed(Placement("req-9", "dec-1", "http://10.0.0.7:8081", 64, "http://10.0.0.8:8081"))
    span.finish(
        finish_reason="stop", num_input_tokens=1, num_output_tokens=1, num_cached_tokens=0,
        error_type=None,
    )  # fmt: skip
    (genai,) = exporter.get_finished_spans()
    attributes = dict(genai.attributes or {})
    assert attributes["edgeserve.node_id"] == "dec-1"
    assert attributes["edgeserve.prefill_node.address"] == "http://10.0.0.8:8081"


def test_a_nodes_log_lines_carry_its_trace_and_span_ids() -> None:
    """The node span was never made current: a node's log lines (a generation that failed)
    carried the request id but no trace or span id, unlike the gateway's."""
    import contextvars

    from common.telemetry.logs import JsonLogFormatter

    node = NodeTelemetry(
        setup_telemetry(
            TelemetrySettings("node"), span_processors=[SimpleSpanProcessor(InMemorySpanExporter())]
        ),
        "node-7",
        lambda: STATS,
    )
    headers = {"traceparent": f"00-{'ab' * 16}-{'cd' * 8}-01"}
    body = GenerateRequest(request_id="r-9", model="smollm2", prompt="hi", max_tokens=1)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonLogFormatter())
    log = logging.getLogger("gpu_node.server")
    log.addHandler(handler)

    def serve():  # one request's task: the context it sets ends with it
        span = node.start(headers, body, num_prompt_tokens=3, started_ns=1)
        log.error("generation r-9 failed")
        return span

    try:
        span = contextvars.copy_context().run(serve)
    finally:
        log.removeHandler(handler)
    line = json.loads(stream.getvalue())
    assert {k: v for k, v in line.items() if k != "time"} == {
        "level": "ERROR",
        "logger": "gpu_node.server",
        "message": "generation r-9 failed",
        "request_id": "r-9",
        "trace_id": "ab" * 16,
        "span_id": format(span.span.get_span_context().span_id, "016x"),
    }
