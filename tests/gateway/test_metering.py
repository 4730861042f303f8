"""Metering's exact answers: the token estimate, admission's refusals as the client reads
them, the reservation settled at the tokens used, and the usage records of a request that
finishes and of one its client leaves, read from a node on loopback."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from common.node_api import ChatMessage, GenerateParams
from common.telemetry import TelemetrySettings, setup_telemetry
from gateway.admission import LimitPolicy, Limits, LocalLimiter
from gateway.catalog import CatalogModel
from gateway.dispatch import Dispatcher, GenerationJob
from gateway.errors import BadRequestError, RateLimitedError, TokenLimitError
from gateway.metering import BilledUsage, Meter, billed_usage, estimate_tokens, start_event
from gateway.tracing import GenAITracer
from gateway.upstream import Finished, TextChunk
from scheduler.capacity import CapacityRecord, CapacityView, LocalCapacityRegistry
from scheduler.placement import LocalReservations, Placer
from tests.conftest import ListSink, ServerThread

MODEL = CatalogModel("@cf/test/tiny", "tiny", "tiny-id", "a test model", context_window=1024)
POLICY = LimitPolicy(default=Limits(requests_per_minute=2, tokens_per_minute=100))


def _job(request_id: str, max_tokens: int = 10, *, account_id: str = "acct") -> GenerationJob:
    payload = GenerateParams(prompt="hello", max_tokens=max_tokens)
    return GenerationJob(request_id, account_id, MODEL, payload, estimate_tokens(payload))


def _tracer() -> GenAITracer:
    return GenAITracer(setup_telemetry(TelemetrySettings("test-gateway", is_tracing=False)))


def test_the_estimate_is_characters_over_three_plus_markers_plus_max_tokens() -> None:
    assert estimate_tokens(GenerateParams(prompt="x" * 30, max_tokens=5)) == 10 + 8 + 5
    messages = [ChatMessage(role="system", content="abc"), ChatMessage(role="user", content="de")]
    assert estimate_tokens(GenerateParams(messages=messages, max_tokens=1)) == 37 // 3 + 8 + 1


async def test_admission_reserves_the_estimate_and_settles_at_the_tokens_used() -> None:
    meter = Meter(LocalLimiter(POLICY, clock=lambda: 1000.0), None)
    tracer = _tracer()
    first = _job("r1", max_tokens=30)  # 5 // 3 + 8 + 30 = 39 tokens reserved
    headers = await meter.admit(first, tracer.start(first))
    assert headers["x-ratelimit-remaining-tokens"] == "61"
    assert headers["x-ratelimit-remaining-requests"] == "1"
    await meter.release(first, 12)  # what it used: 100 - 12 left for the minute
    second = _job("r2", max_tokens=30)
    headers = await meter.admit(second, tracer.start(second))
    assert headers["x-ratelimit-remaining-tokens"] == str(100 - 12 - 39)


async def test_admission_refusals_are_the_clients_errors() -> None:
    meter = Meter(LocalLimiter(POLICY, clock=lambda: 1000.0), None)
    tracer = _tracer()
    huge = _job("huge", max_tokens=200)
    with pytest.raises(TokenLimitError) as too_large:
        await meter.admit(huge, tracer.start(huge))
    assert too_large.value.message == (
        "request reserves 209 tokens (its prompt, estimated from its length, plus max_tokens), "
        "more than the account's limit of 100 tokens per minute; shorten the prompt or lower "
        "max_tokens"
    )
    odd = _job("r0", account_id="has space")
    with pytest.raises(BadRequestError) as bad:
        await meter.admit(odd, tracer.start(odd))
    assert bad.value.message.startswith("cannot admit this request: account id 'has space' must")
    for request_id in ("r1", "r2"):
        await meter.admit(_job(request_id), tracer.start(_job(request_id)))
    with pytest.raises(RateLimitedError) as limited:
        await meter.admit(_job("r3"), tracer.start(_job("r3")))
    assert limited.value.message == "rate limited: too many requests for this account"
    assert limited.value.headers["x-ratelimit-remaining-requests"] == "0"


async def test_without_a_limiter_everything_is_admitted_with_no_headers() -> None:
    assert await Meter(None, None).admit(_job("r1"), _tracer().start(_job("r1"))) == {}


# ---- usage records, from a node on loopback ----------------------------------------------

FIRST = b'{"text":"a","token_ids":[1],"prompt_tokens":7,"cached_tokens":3}\n'
LINES = [
    FIRST,
    b'{"text":"b","token_ids":[2]}\n',
    b'{"finish_reason":"stop","usage":{"prompt_tokens":7,"completion_tokens":2,'
    b'"cached_tokens":3}}\n',
]


def _scripted_node() -> Starlette:
    """A stand-in node that answers every generation with LINES (exact counts to bill)."""

    async def generate(request: Request) -> StreamingResponse:
        async def lines() -> AsyncIterator[bytes]:
            for line in LINES:
                yield line

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    async def cancel(request: Request) -> Response:
        return Response(status_code=204)

    return Starlette(
        routes=[
            Route("/internal/v1/generate", generate, methods=["POST"]),
            Route("/internal/v1/requests/{request_id}", cancel, methods=["DELETE"]),
        ]
    )


@pytest.fixture(scope="module")
def node() -> Iterator[ServerThread]:
    server = ServerThread(_scripted_node()).start()
    yield server
    server.stop()


async def _dispatcher(node: ServerThread, client: httpx.AsyncClient, sink: Any) -> Dispatcher:
    registry = LocalCapacityRegistry()
    record = CapacityRecord(
        "node-1", node.url, "mixed", ("tiny",), 1000, 1000, 16, "fp32", 0, 0, 0.0,
        time.time(), 300.0, "fp32",
    )  # fmt: skip
    await registry.publish(record)
    placer = Placer(CapacityView(registry, max_age_s=60.0), LocalReservations())
    return Dispatcher(client, placer, "t", usage_sink=sink)


async def test_a_finished_stream_is_billed_what_the_node_reported(node: ServerThread) -> None:
    sink = ListSink()
    async with httpx.AsyncClient() as client:
        dispatcher = await _dispatcher(node, client, sink)
        upstream = await dispatcher.open(_job("r-done", max_tokens=8))
        events = [event async for event in upstream.events()]
        await upstream.close()
    assert events == [TextChunk("a", 1), TextChunk("b", 1), Finished("stop", 7, 2, 3)]
    assert billed_usage(upstream) == BilledUsage("ok", 7, 2, 3)
    (event,) = sink.events
    assert (event.request_id, event.node_id, event.status) == ("r-done", "node-1", "ok")
    assert (event.input_tokens, event.output_tokens, event.cached_tokens) == (7, 2, 3)
    assert sink.starts == []  # a whole answer needs no start record


async def test_a_stream_its_client_leaves_is_billed_what_was_computed_and_delivered(
    node: ServerThread,
) -> None:
    sink = ListSink()
    job = GenerationJob(
        "r-left", "acct", MODEL, GenerateParams(prompt="hello", max_tokens=8), 20, stream=True
    )
    async with httpx.AsyncClient() as client:
        dispatcher = await _dispatcher(node, client, sink)
        upstream = await dispatcher.open(job)
        assert sink.starts == []  # the relay records it, once the status line is out
        await upstream.record_start()
        (start,) = sink.starts
        assert start == start_event(upstream)
        assert (start.status, start.input_tokens, start.output_tokens) == ("cancelled", 7, 0)
        assert start.cached_tokens == 3 and start.started_at == start.ended_at
        events = upstream.events()
        first = await anext(events)
        assert first == TextChunk("a", 1)
        upstream.mark_delivered(1)
        await events.aclose()  # the client leaves after the first chunk
        await upstream.close()
    assert billed_usage(upstream) == BilledUsage("cancelled", 7, 1, 3)
    (event,) = sink.events
    assert (event.status, event.input_tokens, event.output_tokens, event.cached_tokens) == (
        "cancelled",
        7,
        1,
        3,
    )
