"""A whole answer whose node fails midway starts again on another node, and nothing it
reserved outlives it, whichever way it ends.

The nodes are stand-ins served on loopback: a node that fails after its first event, and
one slow to send its first; no real node can be told to do either on cue.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from scheduler.capacity import CapacityRecord, LocalCapacityRegistry
from scheduler.placement import LocalReservations
from tests.conftest import SMOLLM2, ListSink, ServerThread
from tests.loopback import API_KEY, Node, start_gateway

pytestmark = pytest.mark.timeout(60)

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
