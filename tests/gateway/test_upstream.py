"""A node's answer as the gateway reads it (`Upstream`): its NDJSON split on the `\\n` byte
alone, whatever text it carries; an event that cannot be read is the node's failure; a whole
answer whose node fails midway starts again on another node, and nothing it reserved
outlives it, whichever way it ends.

The nodes are stand-ins served on loopback: a node that fails after its first event, one
slow to send its first, one that breaks its own wire; no real node can be told to do any of
them on cue.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from common.node_api import TokenChunk, event_line, read_event
from gateway.upstream import _split_lines
from scheduler.capacity import CapacityRecord, LocalCapacityRegistry
from scheduler.placement import LocalReservations
from tests.conftest import SMOLLM2, ListSink, ServerThread, sse_data
from tests.loopback import API_KEY, Node, start_gateway

pytestmark = pytest.mark.timeout(60)

# Every general category of code point but the surrogates (no UTF-8 text holds one).
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)

FIRST = {"text": "a", "token_ids": [1], "prompt_tokens": 5, "cached_tokens": 0}
END = {"finish_reason": "stop", "usage": {"prompt_tokens": 5, "completion_tokens": 2, "cached_tokens": 0}}  # fmt: skip


def _stand_in(*, fails_midway: bool, first_after_s: float) -> Starlette:
    async def generate(request: Request) -> StreamingResponse:
        async def lines() -> AsyncIterator[bytes]:
            await asyncio.sleep(first_after_s)
            yield json.dumps(FIRST).encode() + b"\n"
            if fails_midway:
                yield b'{"error": {"code": "internal", "message": "boom"}}\n'
                return
            yield json.dumps({"text": "b", "token_ids": [2]}).encode() + b"\n"
            yield json.dumps(END).encode() + b"\n"

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    async def cancel(request: Request) -> Response:
        return Response(status_code=204)

    return Starlette(
        routes=[
            Route("/internal/v1/generate", generate, methods=["POST"]),
            Route("/internal/v1/requests/{request_id}", cancel, methods=["DELETE"]),
        ]
    )


def _record(node_id: str, url: str, num_free_pages: int) -> CapacityRecord:
    return CapacityRecord(
        node_id, url, "mixed", ("smollm2",), 1000, num_free_pages, 16, "fp32", 0, 0, 0.0,
        time.time(), 300.0, "fp32",
    )  # fmt: skip


@pytest.fixture
def fleet(
    request: pytest.FixtureRequest,
) -> Iterator[tuple[ServerThread, LocalReservations, ListSink]]:
    """node-a (the freer: chosen first) fails after its first event; node-b answers after
    `request.param` seconds."""
    node_a = ServerThread(_stand_in(fails_midway=True, first_after_s=0.0)).start()
    node_b = ServerThread(_stand_in(fails_midway=False, first_after_s=request.param)).start()
    registry = LocalCapacityRegistry()
    asyncio.run(registry.publish(_record("node-a", node_a.url, 1000)))
    asyncio.run(registry.publish(_record("node-b", node_b.url, 500)))
    reservations, sink = LocalReservations(), ListSink()
    gateway = start_gateway(
        Node(node_a, registry), reservations=reservations, usage_sink=sink,
        settings={"node_silence_s": 30.0},
    )  # fmt: skip
    yield gateway, reservations, sink
    gateway.stop()
    node_a.stop()
    node_b.stop()


def _ask(url: str, timeout_s: float) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions",
        json={"model": SMOLLM2, "prompt": "hi", "max_tokens": 8, "temperature": 0},
        headers={"authorization": f"Bearer {API_KEY}"},
        timeout=timeout_s,
    )


async def _reserved(reservations: LocalReservations) -> list[int]:
    return [await reservations.reserved_tokens(n) for n in ("node-a", "node-b")]


@pytest.mark.parametrize("fleet", [0.0], indirect=True)
def test_the_second_node_answers_whole_and_both_reservations_go_back(fleet: Any) -> None:
    gateway, reservations, sink = fleet
    response = _ask(gateway.url, 30)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == "ab"
    event = sink.event_of(response.headers["x-request-id"])
    assert (event.node_id, event.status, event.output_tokens) == ("node-b", "ok", 2)
    assert asyncio.run(_reserved(reservations)) == [0, 0]


@pytest.mark.parametrize("fleet", [3.0], indirect=True)
def test_a_client_that_leaves_while_the_second_node_starts_leaves_nothing_reserved(
    fleet: Any,
) -> None:
    gateway, reservations, sink = fleet
    with pytest.raises(httpx.ReadTimeout):
        _ask(gateway.url, 1.0)  # leaves while node-b has not sent its first event
    deadline = time.monotonic() + 5
    while (reserved := asyncio.run(_reserved(reservations))) != [0, 0]:
        assert time.monotonic() < deadline, f"still reserved: {reserved}"
        time.sleep(0.05)
    event = sink.event_after(0)
    assert (event.node_id, event.status, event.output_tokens) == ("node-a", "error", 0)


# -- what the node's stream carries: split on its lines alone, a broken event its failure ---


def _chunked(data: bytes, cuts: list[int]) -> AsyncIterator[bytes]:
    """`data` in pieces cut at `cuts` (inside a character or a line end alike)."""

    async def pieces() -> AsyncIterator[bytes]:
        start = 0
        for cut in [*sorted({c % (len(data) + 1) for c in cuts}), len(data)]:
            yield data[start:cut]
            start = cut

    return pieces()


async def _lines(data: bytes, cuts: list[int]) -> list[str]:
    return [line async for line in _split_lines(_chunked(data, cuts))]


@pytest.mark.timeout(180)
@settings(max_examples=300, deadline=None)
@given(texts=st.lists(TEXT, min_size=1, max_size=6), cuts=st.lists(st.integers(0, 10_000)))
def test_node_events_split_back_into_the_events_the_node_wrote(
    texts: list[str], cuts: list[int]
) -> None:
    events = [TokenChunk(text=t, token_ids=[i]) for i, t in enumerate(texts)]
    wire = b"".join(event_line(e) for e in events)
    assert [read_event(line) for line in asyncio.run(_lines(wire, cuts))] == events


BROKEN_EVENTS = {
    "not-json": b'{"text": "1", "token_ids": [16]',
    "no-usage": b'{"finish_reason": "stop"}',
    "text-not-str": b'{"text": 7, "token_ids": [16]}',
    "not-an-object": b"[1, 2]",
}


def _broken_node(line: bytes) -> Any:
    """A stand-in for a node whose stream breaks after its first token (no real node writes
    such lines, which is why it stands in): the first event, then `line`."""
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    async def generate(request: Any) -> StreamingResponse:
        async def lines() -> AsyncIterator[bytes]:
            yield b'{"text":"1","token_ids":[16],"prompt_tokens":5,"cached_tokens":0}\n'
            yield line + b"\n"

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    return Starlette(routes=[Route("/internal/v1/generate", generate, methods=["POST"])])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("line", BROKEN_EVENTS.values(), ids=BROKEN_EVENTS.keys())
def test_a_node_event_that_cannot_be_read_is_the_nodes_failure_billed_as_an_error(
    line: bytes,
) -> None:
    from scheduler.capacity import CapacityRecord, LocalCapacityRegistry
    from tests.conftest import ListSink, ServerThread

    broken = ServerThread(_broken_node(line)).start()
    registry = LocalCapacityRegistry()
    record = CapacityRecord(
        "node-broken", broken.url, "mixed", ("smollm2",), 1000, 1000, 16, "fp32", 0, 0, 0.0,
        time.time(), 300.0, "fp32",
    )  # fmt: skip
    asyncio.run(registry.publish(record))
    sink = ListSink()
    gateway = start_gateway(Node(broken, registry), usage_sink=sink)
    headers = {"authorization": f"Bearer {API_KEY}"}
    body = {"model": SMOLLM2, "prompt": "Hi", "max_tokens": 8, "temperature": 0}
    try:
        whole = httpx.post(f"{gateway.url}/v1/completions", json=body, headers=headers, timeout=30)
        assert whole.status_code == 502
        assert whole.json()["error"] == {
            "message": "the node serving this request failed mid-answer",
            "type": "server_error",
            "param": None,
            "code": "upstream_error",
        }
        with httpx.stream(
            "POST", f"{gateway.url}/v1/completions", json=body | {"stream": True},
            headers=headers, timeout=30,
        ) as response:  # fmt: skip
            assert response.status_code == 200
            data = sse_data(response.read())
        assert json.loads(data[0])["choices"][0]["text"] == "1"
        assert json.loads(data[-1])["error"]["code"] == "upstream_error"  # no [DONE]
        for response_id in (whole.headers["x-request-id"], response.headers["x-request-id"]):
            event = sink.event_of(response_id)
            assert (event.status, event.node_id) == ("error", "node-broken")
    finally:
        gateway.stop()
        broken.stop()
