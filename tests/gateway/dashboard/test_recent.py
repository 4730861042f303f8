"""The gateway's recent failures: the ring, the message read from an error body, and the
middleware that fills the ring, around a tiny app on loopback."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from gateway.dashboard.recent import (
    MAX_MESSAGE_CHARS,
    MAX_PATH_CHARS,
    RecentError,
    RecentErrors,
    RecentErrorsMiddleware,
    error_message,
)
from gateway.errors import ContextWindowError, UpstreamError, error_body
from gateway.relay import STREAM_FAILURE
from tests.conftest import ServerThread


def test_the_ring_keeps_the_newest_first_and_cuts_long_fields() -> None:
    clock = iter([1.0, 2.0, 3.0])
    ring = RecentErrors(capacity=2, clock=lambda: next(clock))
    ring.add("POST", "/a", 500, "first", "r1")
    ring.add("GET", "/b" + "x" * 500, 502, "m" * 1000, None)
    ring.add("POST", "/c", 503, "third", "r3")
    assert ring.latest() == [
        RecentError(3.0, "POST", "/c", 503, "third", "r3"),
        RecentError(2.0, "GET", ("/b" + "x" * 500)[:MAX_PATH_CHARS], 502,
                    "m" * MAX_MESSAGE_CHARS, None),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"result":null,"success":false,"errors":[{"code":3043,"message":"wa"}]}', "wa"),
        (b'{"error":{"message":"oa","type":"server_error"}}', "oa"),
        (b'{"errors":[],"error":{"message":"oa"}}', "oa"),
        (b'{"error":{"message":7}}', ""),
        (b"[1, 2]", ""),
        (b"Internal Server Error", ""),
        (b"", ""),
    ],
)
def test_the_message_is_read_from_either_dialects_body(body: bytes, message: str) -> None:
    assert error_message(body) == message


def _app(ring: RecentErrors) -> RecentErrorsMiddleware:
    async def failed(request: Request) -> Response:
        return JSONResponse(error_body(UpstreamError("a node failed"), "openai"), 502)

    async def crashed(request: Request) -> Response:
        return PlainTextResponse("Internal Server Error", 500)

    async def loading(request: Request) -> Response:
        return PlainTextResponse("loading", 503)

    async def refused(request: Request) -> Response:
        return JSONResponse(error_body(ContextWindowError("too long"), "openai"), 400)

    async def stream_failed(request: Request) -> Response:
        request.scope.setdefault("state", {})[STREAM_FAILURE] = ContextWindowError("cut")
        return PlainTextResponse("data: {}\n\n", 200)

    routes = [
        Route("/failed", failed, methods=["POST"]),
        Route("/crashed", crashed),
        Route("/healthz", loading),
        Route("/refused", refused),
        Route("/stream", stream_failed),
    ]
    return RecentErrorsMiddleware(Starlette(routes=routes), ring)


@pytest.fixture
def served() -> Iterator[tuple[str, RecentErrors]]:
    ring = RecentErrors()
    server = ServerThread(_app(ring)).start()
    yield server.url, ring
    server.stop()


def test_5xx_answers_and_failed_streams_are_listed_and_nothing_else(
    served: tuple[str, RecentErrors],
) -> None:
    url, ring = served
    assert httpx.post(f"{url}/failed").status_code == 502
    assert httpx.get(f"{url}/crashed").status_code == 500
    assert httpx.get(f"{url}/healthz").status_code == 503  # a probe: not a failure
    assert httpx.get(f"{url}/refused").status_code == 400  # the client's error
    assert httpx.get(f"{url}/missing").status_code == 404
    assert httpx.get(f"{url}/stream").status_code == 200  # its stream ended in an error
    assert [(e.method, e.path, e.status, e.message, e.request_id) for e in ring.latest()] == [
        ("GET", "/stream", 400, "cut", None),  # the status its error has
        ("GET", "/crashed", 500, "", None),
        ("POST", "/failed", 502, "a node failed", None),
    ]
