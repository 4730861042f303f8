"""One request through the real gateway and the real SmolLM2 node, as an operator sees it:
one trace across both (in memory and at an OTLP/HTTP receiver on loopback), the GenAI
metrics at /metrics, JSON logs with the request and trace ids, and no prompt text
anywhere unless content recording is on.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from common.telemetry import (
    REQUEST_DURATION_BUCKETS,
    TIME_PER_OUTPUT_TOKEN_BUCKETS,
    TIME_TO_FIRST_TOKEN_BUCKETS,
    TOKEN_USAGE_BUCKETS,
    JsonLogHandler,
    Telemetry,
    TelemetrySettings,
    setup_telemetry,
)
from tests.conftest import (
    ACCOUNT_ID,
    INTERNAL_TOKEN,
    SMOLLM2,
    ServerThread,
    free_port,
    start_local_gateway,
    wait_for_nodes,
)

pytestmark = pytest.mark.slow

MARKER = "zebra-quasar-4471"  # in every prompt: it must never reach a span or a log by default
MODEL_SPAN = f"chat {SMOLLM2}"
LIMITED_ACCOUNT = "acct-limited"  # one request per minute


class OtlpReceiver:
    """A small OTLP/HTTP trace receiver: decodes each protobuf export and keeps it."""

    def __init__(self) -> None:
        self.exports: list[ExportTraceServiceRequest] = []
        self._lock = threading.Lock()

    def app(self) -> Starlette:
        async def traces(request: Request) -> Response:
            assert request.headers["content-type"] == "application/x-protobuf"
            export = ExportTraceServiceRequest()
            export.ParseFromString(await request.body())
            with self._lock:
                self.exports.append(export)
            body = ExportTraceServiceResponse().SerializeToString()
            return Response(body, media_type="application/x-protobuf")

        return Starlette(routes=[Route("/v1/traces", traces, methods=["POST"])])

    def spans(self) -> list[tuple[str, Any]]:
        """(service.name, span) of every span received so far."""
        out = []
        with self._lock:
            exports = list(self.exports)
        for export in exports:
            for resource_spans in export.resource_spans:
                service = next(
                    a.value.string_value
                    for a in resource_spans.resource.attributes
                    if a.key == "service.name"
                )
                for scope_spans in resource_spans.scope_spans:
                    out += [(service, span) for span in scope_spans.spans]
        return out


@dataclass
class TracedStack:
    gateway: ServerThread
    node: ServerThread
    api_key: str
    limited_key: str
    gateway_telemetry: Telemetry
    node_telemetry: Telemetry
    exporter: InMemorySpanExporter

    def flush(self) -> None:
        assert self.gateway_telemetry.force_flush() and self.node_telemetry.force_flush()

    def spans_of_request(self, request_id: str) -> list[ReadableSpan]:
        """Every span of the trace whose server span answered `request_id`.

        The server span ends just after the last byte is sent, so a client that has read
        the whole answer may look before it is finished: wait for it (bounded).
        """
        deadline = time.monotonic() + 5
        while True:
            self.flush()
            spans = self.exporter.get_finished_spans()
            roots = [
                s
                for s in spans
                if s.kind is SpanKind.SERVER
                and s.parent is None
                and (s.attributes or {}).get("edgeserve.request_id") == request_id
            ]
            if roots or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert len(roots) == 1, [s.name for s in spans]
        trace_id = roots[0].context.trace_id
        # The node's span may end a moment after the gateway's: until the trace is still.
        found: list[ReadableSpan] = []
        while True:
            self.flush()
            now = [s for s in self.exporter.get_finished_spans() if s.context.trace_id == trace_id]
            if len(now) == len(found) or time.monotonic() > deadline:
                return now
            found = now
            time.sleep(0.05)


def start_traced_stack(
    engine: Any, otlp_url: str | None, *, record_content: bool = False
) -> TracedStack:
    from gateway.admission import Limits, LocalLimiter, MemoryLimitStore
    from gateway.keys import MemoryKeyStore, new_key
    from gpu_node.server import NodeService, NodeSettings, create_node_app
    from scheduler.capacity import LocalCapacityRegistry

    exporter = InMemorySpanExporter()

    def telemetry(service: str) -> Telemetry:
        settings = TelemetrySettings(
            service, otlp_traces_endpoint=otlp_url, record_content=record_content
        )
        return setup_telemetry(settings, span_processors=[SimpleSpanProcessor(exporter)])

    gateway_telemetry, node_telemetry = telemetry("edgeserve-gateway"), telemetry("edgeserve-node")
    registry = LocalCapacityRegistry()
    node_port = free_port()
    service = NodeService(
        NodeSettings(
            node_id="node-t",
            address=f"http://127.0.0.1:{node_port}",
            internal_token=INTERNAL_TOKEN,
            heartbeat_s=0.2,
            ttl_s=2.0,
        ),
        registry,
        engine=engine,
    )
    node = ServerThread(create_node_app(service, telemetry=node_telemetry), node_port).start()
    keys = MemoryKeyStore()
    api_key, limited_key = new_key(), new_key()
    asyncio.run(keys.add(api_key, ACCOUNT_ID))
    asyncio.run(keys.add(limited_key, LIMITED_ACCOUNT))
    limits = MemoryLimitStore()
    asyncio.run(limits.save(LIMITED_ACCOUNT, Limits(requests_per_minute=1)))
    gateway = start_local_gateway(
        registry, keys, limiter=LocalLimiter(store=limits), telemetry=gateway_telemetry
    )
    wait_for_nodes(registry)
    return TracedStack(
        gateway, node, api_key, limited_key, gateway_telemetry, node_telemetry, exporter
    )


@pytest.fixture(scope="module")
def otlp() -> Iterator[tuple[OtlpReceiver, ServerThread]]:
    receiver = OtlpReceiver()
    server = ServerThread(receiver.app()).start()
    yield receiver, server
    server.stop()


@pytest.fixture(scope="module")
def logs() -> Iterator[io.StringIO]:
    """Every log line of the module's servers, as JSON, at DEBUG."""
    stream = io.StringIO()
    handler = JsonLogHandler(stream)
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    yield stream
    root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture(scope="module")
def stack(
    engine: Any, otlp: tuple[OtlpReceiver, ServerThread], logs: io.StringIO
) -> Iterator[TracedStack]:
    started = start_traced_stack(engine, f"{otlp[1].url}/v1/traces")
    yield started
    started.gateway.stop()
    started.node.stop()
    started.gateway_telemetry.shutdown()
    started.node_telemetry.shutdown()


@dataclass(frozen=True)
class Streamed:
    request_id: str
    text: str
    usage: dict[str, Any]
    finish_reason: str


def stream_chat(stack: TracedStack, content: str, **params: Any) -> Streamed:
    body = {
        "model": SMOLLM2,
        "messages": [{"role": "user", "content": content}],
        "stream": True,
        "stream_options": {"include_usage": True},
        **params,
    }
    parts, usage, reason = [], None, None
    with httpx.stream(
        "POST",
        f"{stack.gateway.url}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {stack.api_key}"},
        timeout=60,
    ) as response:
        assert response.status_code == 200, response.read()
        request_id = response.headers["x-request-id"]
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if event.get("usage"):
                usage = event["usage"]
            for choice in event["choices"]:
                parts.append(choice["delta"].get("content", ""))
                reason = choice["finish_reason"] or reason
    assert usage is not None and reason is not None
    return Streamed(request_id, "".join(parts), usage, reason)


@pytest.fixture(scope="module")
def streamed(stack: TracedStack) -> Streamed:
    return stream_chat(
        stack, f"Say hello to {MARKER}.", max_tokens=6, temperature=0.7, top_p=0.9, seed=11
    )


def by_name(spans: list[ReadableSpan]) -> dict[str, ReadableSpan]:
    named = {s.name: s for s in spans}
    assert len(named) == len(spans), sorted(s.name for s in spans)
    return named


def test_one_streamed_request_is_one_trace_across_gateway_and_node(
    stack: TracedStack, streamed: Streamed, engine: Any
) -> None:
    spans = by_name(stack.spans_of_request(streamed.request_id))
    assert sorted(spans) == sorted(
        ["POST /v1/chat/completions", MODEL_SPAN, "admission", "placement", "generate smollm2"]
    )
    server, genai, node = (
        spans["POST /v1/chat/completions"],
        spans[MODEL_SPAN],
        spans["generate smollm2"],
    )
    assert server.parent is None and server.kind is SpanKind.SERVER
    assert genai.parent is not None and genai.parent.span_id == server.context.span_id
    assert genai.kind is SpanKind.CLIENT
    for child in (spans["admission"], spans["placement"], node):
        assert child.parent is not None and child.parent.span_id == genai.context.span_id
    assert node.kind is SpanKind.SERVER
    assert server.resource.attributes["service.name"] == "edgeserve-gateway"
    assert node.resource.attributes["service.name"] == "edgeserve-node"

    usage = streamed.usage
    attributes = dict(genai.attributes or {})
    ttfc = attributes.pop("gen_ai.response.time_to_first_chunk")
    assert 0 < ttfc < (genai.end_time - genai.start_time) / 1e9  # type: ignore[operator]
    assert attributes == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "edgeserve",
        "gen_ai.request.model": SMOLLM2,
        "gen_ai.request.max_tokens": 6,
        "gen_ai.request.temperature": 0.7,
        "gen_ai.request.top_p": 0.9,
        "gen_ai.request.seed": 11,
        "gen_ai.request.stream": True,
        "gen_ai.response.id": streamed.request_id,
        "gen_ai.response.model": SMOLLM2,
        "gen_ai.response.finish_reasons": ("length",),
        "gen_ai.usage.input_tokens": usage["prompt_tokens"],
        "gen_ai.usage.output_tokens": usage["completion_tokens"],
        "gen_ai.usage.cache_read.input_tokens": usage["prompt_tokens_details"]["cached_tokens"],
        "server.address": "127.0.0.1",
        "server.port": stack.node.port,
        "edgeserve.account_id": ACCOUNT_ID,
        "edgeserve.request_id": streamed.request_id,
        "edgeserve.node_model": "smollm2",
        "edgeserve.node_id": "node-t",
    }
    assert usage["completion_tokens"] == 6 and streamed.finish_reason == "length"

    node_attributes = dict(node.attributes or {})
    assert node_attributes["gen_ai.response.id"] == streamed.request_id
    assert node_attributes["edgeserve.account_id"] == ACCOUNT_ID
    assert node_attributes["edgeserve.node_id"] == "node-t"
    assert node_attributes["edgeserve.kv_dtype"] == engine.stats().kv_dtype
    assert node_attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert node_attributes["gen_ai.usage.output_tokens"] == 6
    names = [e.name for e in node.events]
    assert names[:3] == ["queued", "admitted", "first_token"] and names[-1] == "finished"
    pages = {e.name: (e.attributes or {})["edgeserve.kv_pages"] for e in node.events}
    page_size = engine.stats().page_size
    needed = -(-(usage["prompt_tokens"] + 6) // page_size)  # pages for prompt + 6 tokens
    assert pages["queued"] == 0
    assert node_attributes["edgeserve.kv_pages"] in (
        needed - 1,
        needed,
    )  # the last token's KV is never written
    times = [e.timestamp for e in node.events]
    assert times == sorted(times)
    assert server.start_time <= genai.start_time <= node.start_time  # type: ignore[operator]
    assert node.end_time <= genai.end_time <= server.end_time  # type: ignore[operator]
    assert server.attributes is not None
    assert server.attributes["http.response.status_code"] == 200


def test_the_same_trace_reaches_an_otlp_http_receiver(
    stack: TracedStack, streamed: Streamed, otlp: tuple[OtlpReceiver, ServerThread]
) -> None:
    expected = stack.spans_of_request(streamed.request_id)  # flushes both exporters
    trace_id = expected[0].context.trace_id.to_bytes(16, "big")
    received = [(svc, s) for svc, s in otlp[0].spans() if s.trace_id == trace_id]
    assert sorted((svc, s.name) for svc, s in received) == sorted(
        (s.resource.attributes["service.name"], s.name) for s in expected
    )
    genai = next(s for _, s in received if s.name == MODEL_SPAN)
    values = {a.key: a.value for a in genai.attributes}
    assert values["gen_ai.usage.output_tokens"].int_value == streamed.usage["completion_tokens"]
    assert values["gen_ai.response.id"].string_value == streamed.request_id
    node = next(s for _, s in received if s.name == "generate smollm2")
    assert node.parent_span_id == genai.span_id
    assert [e.name for e in node.events][:3] == ["queued", "admitted", "first_token"]


def histograms(text: str) -> dict[str, list[float]]:
    """Histogram name -> the bucket upper bounds of its first label set."""
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        if family.type != "histogram" or not family.samples:
            continue
        first = {k: v for k, v in family.samples[0].labels.items() if k != "le"}
        out[family.name] = [
            float(s.labels["le"])
            for s in family.samples
            if s.name.endswith("_bucket")
            and {k: v for k, v in s.labels.items() if k != "le"} == first
        ]
    return out


def test_metrics_expose_the_genai_histograms_with_the_conventions_buckets(
    stack: TracedStack, streamed: Streamed
) -> None:
    inf = float("inf")
    expected = {
        "gen_ai_server_time_to_first_token_seconds": [*TIME_TO_FIRST_TOKEN_BUCKETS, inf],
        "gen_ai_server_time_per_output_token_seconds": [*TIME_PER_OUTPUT_TOKEN_BUCKETS, inf],
        "gen_ai_server_request_duration_seconds": [*REQUEST_DURATION_BUCKETS, inf],
        "gen_ai_client_token_usage": [*map(float, TOKEN_USAGE_BUCKETS), inf],
    }
    gateway_text = httpx.get(f"{stack.gateway.url}/metrics").text
    assert histograms(gateway_text) == expected
    node_response = httpx.get(
        f"{stack.node.url}/metrics", headers={"authorization": f"Bearer {INTERNAL_TOKEN}"}
    )
    assert node_response.status_code == 200
    assert histograms(node_response.text) == expected
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(gateway_text)
        for s in family.samples
    }
    labels = (
        ("gen_ai_operation_name", "chat"),
        ("gen_ai_provider_name", "edgeserve"),
        ("gen_ai_request_model", SMOLLM2),
        ("gen_ai_response_model", SMOLLM2),
    )
    output = tuple(sorted((*labels, ("gen_ai_token_type", "output"))))
    assert samples[("gen_ai_client_token_usage_sum", output)] >= streamed.usage["completion_tokens"]
    node_values = {
        s.name: s.value
        for family in text_string_to_metric_families(node_response.text)
        for s in family.samples
    }
    assert (
        node_values["edgeserve_kv_pages_used"] + node_values["edgeserve_kv_pages_free"]
        == (node_values["edgeserve_kv_pages"])
    )
    assert node_values["edgeserve_preemptions_total"] >= 0


def test_a_refused_request_is_traced_and_counted_by_reason(stack: TracedStack) -> None:
    def run(max_tokens: int) -> httpx.Response:
        return httpx.post(
            f"{stack.gateway.url}/client/v4/accounts/{LIMITED_ACCOUNT}/ai/run/{SMOLLM2}",
            json={"prompt": "Hi", "max_tokens": max_tokens},
            headers={"authorization": f"Bearer {stack.limited_key}"},
            timeout=60,
        )

    assert run(2).status_code == 200
    refused = run(2)
    assert refused.status_code == 429
    spans = by_name(stack.spans_of_request(refused.headers["x-request-id"]))
    root = "POST /client/v4/accounts/{account_id}/ai/run/{model_name:path}"
    assert sorted(spans) == sorted([root, "text_completion " + SMOLLM2, "admission"])
    genai = spans["text_completion " + SMOLLM2]
    assert genai.attributes is not None and spans["admission"].attributes is not None
    assert genai.attributes["error.type"] == "RateLimitedError"
    assert genai.attributes["edgeserve.admission.rejection_reason"] == "requests"
    assert genai.status.is_ok is False and spans["admission"].status.is_ok is False
    assert [e.name for e in spans["admission"].events] == ["exception"]
    assert spans[root].attributes is not None
    assert spans[root].attributes["http.response.status_code"] == 429
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(httpx.get(f"{stack.gateway.url}/metrics").text)
        for s in family.samples
    }
    assert samples[("edgeserve_admission_rejections_total", (("reason", "requests"),))] == 1.0
    refused_duration = tuple(
        sorted(
            [
                ("error_type", "RateLimitedError"),
                ("gen_ai_operation_name", "text_completion"),
                ("gen_ai_provider_name", "edgeserve"),
                ("gen_ai_request_model", SMOLLM2),
                ("gen_ai_response_model", SMOLLM2),
            ]
        )
    )
    assert samples[("gen_ai_server_request_duration_seconds_count", refused_duration)] == 1.0


def test_no_prompt_text_in_spans_or_logs_by_default(
    stack: TracedStack, streamed: Streamed, logs: io.StringIO
) -> None:
    spans = stack.spans_of_request(streamed.request_id)
    recorded = json.dumps(
        [
            [dict(s.attributes or {}), [(e.name, dict(e.attributes or {})) for e in s.events]]
            for s in spans
        ],
        default=str,
    )
    assert MARKER not in recorded
    assert streamed.text not in recorded or not streamed.text.strip()
    lines = [json.loads(line) for line in logs.getvalue().splitlines()]
    assert MARKER not in logs.getvalue()
    trace_id = format(spans[0].context.trace_id, "032x")
    mine = [line for line in lines if line.get("request_id") == streamed.request_id]
    assert mine, "no log line carries the request id"
    assert all(line["trace_id"] == trace_id for line in mine if "trace_id" in line)
    assert any(line.get("trace_id") == trace_id for line in mine)


def test_content_is_recorded_when_the_setting_asks(engine: Any, logs: io.StringIO) -> None:
    stack = start_traced_stack(engine, None, record_content=True)
    try:
        marker = f"{MARKER}-{uuid.uuid4().hex[:6]}"
        streamed = stream_chat(stack, f"Say hello to {marker}.", max_tokens=4, temperature=0)
        genai = by_name(stack.spans_of_request(streamed.request_id))[MODEL_SPAN]
    finally:
        stack.gateway.stop()
        stack.node.stop()
    attributes = genai.attributes or {}
    assert json.loads(str(attributes["gen_ai.input.messages"])) == [
        {"role": "user", "parts": [{"type": "text", "content": f"Say hello to {marker}."}]}
    ]
    assert json.loads(str(attributes["gen_ai.output.messages"])) == [
        {
            "role": "assistant",
            "parts": [{"type": "text", "content": streamed.text}],
            "finish_reason": "length",
        }
    ]
    assert marker not in logs.getvalue()  # logs never carry content
