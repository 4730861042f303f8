"""`RequestIdMiddleware`: every request gets an id of ours, in its scope and its answer."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route

from gateway.middleware import RequestIdMiddleware
from tests.conftest import ServerThread


def _app() -> RequestIdMiddleware:
    async def echo_id(request: Request) -> PlainTextResponse:
        return PlainTextResponse(request.scope["state"]["request_id"])

    async def stream(request: Request) -> StreamingResponse:
        async def parts() -> AsyncIterator[bytes]:
            yield b"data: 1\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(parts(), media_type="text/event-stream")

    routes = [Route("/id", echo_id), Route("/stream", stream)]
    return RequestIdMiddleware(Starlette(routes=routes))


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    server = ServerThread(_app()).start()
    yield server.url
    server.stop()


def test_the_id_in_the_scope_is_the_one_answered_and_new_each_request(url: str) -> None:
    answers = [httpx.get(f"{url}/id", headers={"x-request-id": "client-chosen"}) for _ in range(3)]
    ids = [a.headers["x-request-id"] for a in answers]
    assert [a.text for a in answers] == ids  # the handler saw the id the client reads
    assert len(set(ids)) == 3 and "client-chosen" not in ids  # ours, never the client's
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)  # a uuid4, hex
    assert answers[0].headers.get_list("x-request-id") == [ids[0]]


def test_streams_and_unknown_routes_carry_one_too(url: str) -> None:
    streamed = httpx.get(f"{url}/stream")
    assert streamed.text == "data: 1\n\ndata: [DONE]\n\n"
    assert len(streamed.headers["x-request-id"]) == 32
    assert len(httpx.get(f"{url}/missing").headers["x-request-id"]) == 32
