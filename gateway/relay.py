"""Relaying a node's stream to the client as server-sent events, chunk by chunk.

`RelayResponse` is a pure-ASGI response: it sends each node event as soon as
it arrives (never buffering the stream), watches for the client leaving at the
same time, and always closes the upstream afterwards (which cancels the
request on the node when it did not finish, so its KV pages are freed at once).
Each dialect supplies a `StreamRenderer` that turns events into SSE bytes.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from starlette.types import Receive, Scope, Send

from gateway.errors import GatewayError, InternalError, UpstreamError
from gateway.json_body import json_bytes
from gateway.upstream import ChoiceEnd, Finished, TextChunk, Upstream, until_client_leaves

# The request scope's state key under which a stream that failed after its 200 leaves its
# error (gateway/dashboard/recent.py lists it).
STREAM_FAILURE = "stream_failure"

log = logging.getLogger(__name__)


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json_bytes(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class StreamRenderer(Protocol):
    def start(self) -> bytes: ...

    def chunk(self, chunk: TextChunk) -> bytes:
        """The events of a chunk of one choice's answer (b"" while its text is held back)."""
        ...

    def end_choice(self, end: ChoiceEnd) -> bytes:
        """The end of one choice of several, before the request's end."""
        ...

    def finish(self, finished: Finished) -> bytes:
        """The closing events, `data: [DONE]` included."""
        ...

    def error(self, error: GatewayError) -> bytes: ...


class RelayResponse:
    def __init__(
        self, upstream: Upstream, renderer: StreamRenderer, headers: dict[str, str]
    ) -> None:
        self.upstream = upstream
        self.renderer = renderer
        self.headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),  # proxies must not buffer the stream
            *((k.lower().encode(), v.encode()) for k, v in headers.items()),
        ]
        self.failure: GatewayError | None = None  # the error that ended the stream
        self._state: dict[str, object] = {}  # the request scope's state, once called

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._state = scope.setdefault("state", {})
        gone = asyncio.Event()
        # Whichever ends first ends the other: a finished stream, or a client gone.
        relay = await until_client_leaves(self.upstream, self._relay(send, gone), receive, gone)
        error = None if relay.cancelled() else relay.exception()
        if error is not None and not isinstance(error, OSError):  # OSError: a send to a gone client
            raise error

    def _fail(self, error: GatewayError) -> None:
        """The error that ends the stream, where the recent errors read it before the stream's
        last bytes go out."""
        self.failure = error
        self._state[STREAM_FAILURE] = error

    async def _relay(self, send: Send, gone: asyncio.Event) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.headers})
        # Billed from here: the client holds the status line and its request id, so a
        # gateway that dies from now on leaves a bill its client can name (docs/billing.md).
        try:
            await self.upstream.record_start()
        except Exception:  # neither the usage stream nor the journal took it
            log.exception("recording the start of %s failed", self.upstream.job.request_id)
            unmetered = InternalError("The answer could not be metered; try again.")
            self._fail(unmetered)
            await send({"type": "http.response.body", "body": self.renderer.error(unmetered)})
            return

        async def body(data: bytes) -> bool:
            """Sends; True when the bytes went to a client still connected.

            A server drops sends to a closed connection silently; the disconnect
            watcher was woken when the connection was lost, so one turn of the loop
            lets it say so before we count what we sent as delivered.
            """
            await send({"type": "http.response.body", "body": data, "more_body": True})
            await asyncio.sleep(0)
            return not gone.is_set()

        if head := self.renderer.start():
            await body(head)
        pending = 0  # tokens generated but not yet sent (their text held back or empty)
        try:
            async for event in self.upstream.events():
                if isinstance(event, TextChunk):
                    pending += event.num_tokens
                    data = self.renderer.chunk(event)
                    if data and await body(data):
                        self.upstream.mark_delivered(pending)
                        pending = 0
                elif isinstance(event, ChoiceEnd):
                    await body(self.renderer.end_choice(event))
                else:
                    await body(self.renderer.finish(event))
        except UpstreamError as exc:
            # After the first byte the status is sent: the failure travels as an event.
            self._fail(exc)
            await body(self.renderer.error(exc))
        await send({"type": "http.response.body", "body": b"", "more_body": False})
