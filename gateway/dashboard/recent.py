"""The gateway's recent failures: a bounded ring of its 5xx answers and of its streams that
failed after their 200 (listed with the status their error has), for the dashboard.

Each entry holds what the access log holds (method, path, status, request id) and the
error message the gateway itself wrote into the answer; never a request body. Readiness
answers (`/healthz` saying "loading") are not failures and are left out.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import GatewayError, shape_of
from gateway.relay import STREAM_FAILURE

MAX_PATH_CHARS = 200
MAX_MESSAGE_CHARS = 300
MAX_BODY_BYTES = 8192  # an error envelope is far smaller; a longer body is not read further
PROBE_PATHS = frozenset({"/healthz"})


@dataclass(frozen=True, slots=True)
class RecentError:
    at: float  # epoch seconds
    method: str
    path: str
    status: int
    message: str  # the error message of the answer's body ("" when it has none)
    request_id: str | None


class RecentErrors:
    """The last `capacity` failures, newest first."""

    def __init__(self, capacity: int = 50, clock: Callable[[], float] = time.time) -> None:
        self._ring: deque[RecentError] = deque(maxlen=capacity)
        self._clock = clock

    def add(
        self, method: str, path: str, status: int, message: str, request_id: str | None
    ) -> None:
        self._ring.append(
            RecentError(
                self._clock(),
                method,
                path[:MAX_PATH_CHARS],
                status,
                message[:MAX_MESSAGE_CHARS],
                request_id,
            )
        )

    def latest(self) -> list[RecentError]:
        return list(reversed(self._ring))


def error_message(body: bytes) -> str:
    """The message of an error body in either dialect (Workers AI `errors[0].message`,
    OpenAI `error.message`); "" for anything else."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return ""
    if not isinstance(parsed, dict):
        return ""
    errors = parsed.get("errors")
    if isinstance(errors, list) and errors and isinstance(errors[0], dict):
        message = errors[0].get("message")
    elif isinstance(error := parsed.get("error"), dict):
        message = error.get("message")
    else:
        message = None
    return message if isinstance(message, str) else ""


class RecentErrorsMiddleware:
    """Adds every 5xx answer, and every stream that ended in an error event, to `errors`.
    Sits inside RequestIdMiddleware (it reads the id)."""

    def __init__(self, app: ASGIApp, errors: RecentErrors) -> None:
        self.app = app
        self._errors = errors

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PROBE_PATHS:
            await self.app(scope, receive, send)
            return
        status = 0
        body = bytearray()
        is_recorded = False

        def record() -> None:
            nonlocal is_recorded
            if is_recorded:
                return
            state = scope.get("state", {})
            failure = state.get(STREAM_FAILURE)
            if status >= 500:
                message = error_message(bytes(body))
            elif isinstance(failure, GatewayError):  # a 200 whose stream ended in an error
                message = failure.message
            else:
                return
            is_recorded = True
            shown = shape_of(failure).openai_status if status < 500 and failure else status
            self._errors.add(
                scope["method"], scope["path"], shown, message, state.get("request_id")
            )

        async def send_observed(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                if status >= 500 and len(body) < MAX_BODY_BYTES:
                    body.extend(message.get("body", b"")[: MAX_BODY_BYTES - len(body)])
                if not message.get("more_body", False):
                    record()  # before the last bytes: a client that has its answer finds it
            await send(message)

        try:
            await self.app(scope, receive, send_observed)
        finally:
            record()  # an answer cut short still counts
