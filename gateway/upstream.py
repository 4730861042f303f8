"""An open generation on one node: its events as they come, and the counts billing reads.

`Upstream.events()` yields the node's text chunks and the final usage; the relay marks
the tokens that reached the client (what a cancelled stream is billed for, by
gateway/metering.py). `Upstream.close()` (through the dispatcher) releases what the
request held and records its usage.
`until_client_leaves` runs an answer (the stream relay's, or `collect`'s whole one) until
it ends or the client leaves, and closes the upstream either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
from starlette.types import Receive

from common.node_api import (
    ErrorEvent,
    Finish,
    NodeEvent,
    TokenChunk,
    TokenLogprob,
    read_event,
)
from gateway.errors import ClientClosedError, UpstreamError
from gateway.liveness import NODE_GONE
from gateway.tracing import GenAISpan
from scheduler.placement import Placement

if TYPE_CHECKING:
    from gateway.dispatch import Dispatcher
    from gateway.jobs import GenerationJob

T = TypeVar("T")

log = logging.getLogger(__name__)

LEFT_BEFORE_ANSWER = "the client closed the connection before the answer began"
# What a client reads when its node fails mid-answer (which node, and how, is logged).
MID_ANSWER = "the node serving this request failed mid-answer"


def node_lines(response: httpx.Response) -> AsyncIterator[str]:
    """The node's NDJSON events as text lines, split on the byte `\\n` alone.

    httpx's `aiter_lines` also ends a line at U+2028, U+2029, U+0085 and the other
    characters `str.splitlines` knows, any of which a model may generate inside a JSON
    string: JSON escapes the control characters (`\\n` among them) but not those, so the
    `\\n` byte is the one line end of our wire."""
    return _split_lines(response.aiter_bytes())


async def _split_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    pending = b""
    async for chunk in chunks:
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            yield line.decode()
    if pending:
        yield pending.decode()


@dataclass(frozen=True)
class TextChunk:
    text: str
    num_tokens: int
    index: int = 0  # the choice it belongs to (a request for n > 1 answers)
    logprobs: tuple[TokenLogprob, ...] = ()  # one a token, when the request asked for them


@dataclass(frozen=True)
class ChoiceEnd:
    """One choice of a request for n > 1 answers has ended (all but the last; the last
    ends with the request's `Finished`)."""

    index: int
    finish_reason: str


@dataclass(frozen=True)
class Finished:
    """The request's end: choice 0's finish reason (each choice's in `finish_reasons`), the
    prompt's tokens once, and the completion tokens of every choice."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reasons: tuple[str, ...] = ()

    def reason_of(self, index: int) -> str:
        return self.finish_reasons[index] if self.finish_reasons else self.finish_reason


Event = TextChunk | ChoiceEnd | Finished


class Upstream:
    """An open generation on one node."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        job: GenerationJob,
        placement: Placement,
        response: httpx.Response,
        lines: AsyncIterator[str],
        first: TokenChunk,
        started_at: float,
        headers: dict[str, str],
        trace: GenAISpan,
    ) -> None:
        self._dispatcher = dispatcher
        self.job = job
        self.trace = trace
        self.headers = headers  # admission's rate-limit headers for the client
        self._started_at = started_at
        self._finished: Finished | None = None
        self._is_unresponsive = False  # the watchdog closed the stream of a silent node
        self._closed = False
        self._has_restarted = False
        self._is_released = False
        self.num_delivered_tokens = 0
        self.client_left = False  # before the answer began: cancelled on the node already
        self._take(placement, response, lines, first)

    def _take(
        self,
        placement: Placement,
        response: httpx.Response,
        lines: AsyncIterator[str],
        first: TokenChunk,
    ) -> None:
        """Reads the answer of `placement`'s node from its first event on."""
        self.placement = placement
        self._response = response
        self._lines = lines
        self._first: NodeEvent | None = first
        self._failed = False
        self._last_heard = time.monotonic()  # when the node last sent a line
        self.prompt_tokens = first.prompt_tokens or 0
        self.cached_tokens = first.cached_tokens or 0
        # The prompt tokens the node had processed by its first event: all of them once it
        # has a token, fewer when it answers a cancel while the prompt still ran.
        self.prefilled_tokens = (
            self.prompt_tokens if first.prefilled_tokens is None else first.prefilled_tokens
        )

    @property
    def node_id(self) -> str:
        return self.placement.node_id

    def _failure(self, what: str) -> UpstreamError:
        detail = f"node {self.node_id} {what}"
        log.warning("request %s: %s", self.job.request_id, detail)
        return UpstreamError(MID_ANSWER, detail=detail)

    async def _watch(self) -> None:
        """Closes the node's stream once the node goes unresponsive mid-answer
        (NodeWatch.until_unresponsive): the pending read then fails at once, where a frozen
        node would have held the client to the read timeout."""
        await self._dispatcher.watch.until_unresponsive(self.placement, lambda: self._last_heard)
        self._is_unresponsive = True
        await self._response.aclose()

    async def events(self) -> AsyncIterator[Event]:
        """The node's events in order; raises UpstreamError if the node fails mid-stream."""
        watchdog = asyncio.ensure_future(self._watch())
        try:
            async for event in self._events():
                yield event
        finally:
            watchdog.cancel()

    async def _events(self) -> AsyncIterator[Event]:
        ends: dict[int, Finish] = {}
        while True:
            if self._first is not None:
                event, self._first = self._first, None
            else:
                try:
                    line = await anext(self._lines)
                except StopAsyncIteration:
                    self._failed = True
                    raise self._failure("closed the stream before the end") from None
                except httpx.HTTPError as exc:
                    self._failed = True
                    if self._is_unresponsive:
                        raise self._failure(self._dispatcher.watch.silence) from None
                    if isinstance(exc, NODE_GONE):
                        await self._dispatcher.watch.mark_down(self.placement)
                    raise self._failure(f"failed mid-stream: {exc!r}") from None
                self._last_heard = time.monotonic()
                if not line:
                    continue
                try:
                    event = read_event(line)
                except ValueError as exc:
                    self._failed = True  # the service's fault: it costs the client nothing
                    raise self._failure(f"sent a line that is no event: {exc!r}") from None
            if isinstance(event, ErrorEvent):
                self._failed = True
                raise self._failure(f"failed mid-stream: {event.error.message}")
            if isinstance(event, Finish):
                ends[event.index] = event
                if len(ends) < self.job.payload.n:
                    yield ChoiceEnd(event.index, event.finish_reason)
                    continue
                usage = event.usage  # the prompt's counts are alike in every choice
                reasons = tuple(ends[i].finish_reason for i in sorted(ends))
                self._finished = Finished(
                    ends[min(ends)].finish_reason,
                    usage.prompt_tokens,
                    sum(end.usage.completion_tokens for end in ends.values()),
                    usage.cached_tokens,
                    reasons if len(reasons) > 1 else (),
                )
                # Read to the end of the body so the connection goes back to the pool.
                with contextlib.suppress(httpx.HTTPError):
                    async for _ in self._lines:
                        pass
                yield self._finished
                return
            self.trace.output(event.text, len(event.token_ids))
            yield TextChunk(
                event.text, len(event.token_ids), event.index, tuple(event.logprobs or ())
            )

    async def restart(self) -> bool:
        """Starts this request again on another node, once, after its node failed before
        anything of it reached the client (a whole answer): this upstream then reads the
        new node's events from the start. False when it cannot (delivered already, retried
        already, no other node); the failure then stands."""
        if self._has_restarted or self.num_delivered_tokens or self._finished is not None:
            return False
        self._has_restarted = True
        await self._response.aclose()
        # reconnect gives the failed node's placement back first; until a second node takes
        # over, closing this upstream releases nothing more and bills the error it is.
        self._is_released = True
        fresh = await self._dispatcher.reconnect(self)
        if fresh is None:
            return False
        self._is_released = False
        assert isinstance(fresh._first, TokenChunk)  # a fresh upstream's first event
        self._take(fresh.placement, fresh._response, fresh._lines, fresh._first)
        return True

    async def close(self) -> None:
        """Cancel on the node if unfinished, release reservations, record usage. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._response.aclose()
        await self._dispatcher.finish(self)

    async def record_start(self) -> None:
        """Records this stream's start for billing (`Dispatcher.record_start`)."""
        await self._dispatcher.record_start(self)

    def mark_delivered(self, num_tokens: int) -> None:
        """Counts tokens whose text reached the client (billed if the request is cancelled)."""
        self.num_delivered_tokens += num_tokens

    @property
    def is_released(self) -> bool:
        """Its placement given back already: a restart found no second node."""
        return self._is_released

    @property
    def is_finished(self) -> bool:
        return self._finished is not None

    @property
    def finished(self) -> Finished | None:
        """The node's end of the request, with its usage; None until it came."""
        return self._finished

    @property
    def has_failed(self) -> bool:
        """The node failed it (closed, broke or garbled its stream, or reported an error)."""
        return self._failed

    @property
    def finish_reason(self) -> str | None:
        return None if self._finished is None else self._finished.finish_reason

    @property
    def started_at(self) -> float:
        return self._started_at


async def _wait_for_disconnect(receive: Receive, gone: asyncio.Event | None) -> None:
    """Returns (setting `gone`) once the client has left; the request's body already read,
    so nothing else is left to come on `receive`."""
    while (await receive())["type"] != "http.disconnect":
        pass
    if gone is not None:
        gone.set()


async def left_first(work: asyncio.Future[Any], receive: Receive) -> bool:
    """Waits until `work` is done or the client leaves; True when the client left first
    (`work` still running, for the caller to end)."""
    watch = asyncio.ensure_future(_wait_for_disconnect(receive, None))
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
    return not work.done()


async def unless_client_leaves(work: Coroutine[Any, Any, T], receive: Receive) -> T:
    """`work`'s result, unless the client leaves first: then `work` is cancelled and
    ClientClosedError raised (the request's body already read, so `receive` has nothing
    left to bring but the disconnect)."""
    task = asyncio.ensure_future(work)
    try:
        left = await left_first(task, receive)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if left:
        raise ClientClosedError(LEFT_BEFORE_ANSWER)
    return task.result()


async def until_client_leaves(
    upstream: Upstream,
    work: Coroutine[Any, Any, T],
    receive: Receive,
    gone: asyncio.Event | None = None,
    *,
    keep_open: bool = False,
) -> asyncio.Future[T]:
    """Runs `work` (answering the client from `upstream`) against the client leaving,
    whichever ends first ending the other, then closes the upstream, which cancels the
    request on the node when it did not finish (with `keep_open`, not when the work
    succeeded: its caller closes it). Returns the work's future: cancelled when the client
    left first, else done with its result or exception. `gone` is set the moment the
    client leaves (the stream relay checks it between sends)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_for_disconnect(receive, gone))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for future in (task, watch):
            future.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
        succeeded = task.done() and not task.cancelled() and task.exception() is None
        if not (keep_open and succeeded):
            # Cleanup must run even if this task is being cancelled (server shutdown).
            await asyncio.shield(upstream.close())
    return task


@dataclass
class Choice:
    """One answer of a whole (not streamed) generation."""

    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str = ""


async def collect(
    upstream: Upstream, receive: Receive, *, keep_open: bool = False
) -> tuple[list[Choice], Finished]:
    """Read a whole generation (non-streaming answers): its choices, in order, and its
    end; closes the upstream, but for a whole answer read with `keep_open`, which its
    caller closes once the client has the status line (`SettlingJSON`). A node that fails
    midway is replaced once by another (`Upstream.restart`).

    `receive` is the client's ASGI channel, its body already read. A client that leaves
    before the answer is whole ends the generation there: it is billed as cancelled, with
    none of its output delivered, and ClientClosedError is raised."""
    payload = upstream.job.payload

    async def read() -> tuple[list[Choice], Finished]:
        while True:
            choices = [Choice(logprobs=[] if payload.logprobs else None) for _ in range(payload.n)]
            parts: list[list[str]] = [[] for _ in range(payload.n)]
            finished: Finished | None = None
            try:
                async for event in upstream.events():
                    if isinstance(event, TextChunk):
                        parts[event.index].append(event.text)
                        if choices[event.index].logprobs is not None:
                            choices[event.index].logprobs.extend(event.logprobs)  # type: ignore[union-attr]
                    elif isinstance(event, Finished):
                        finished = event
            except UpstreamError:
                # Nothing of it reached the client: a second node answers it whole.
                if await upstream.restart():
                    continue
                raise
            assert finished is not None  # events() ends with Finished or raises
            for i, choice in enumerate(choices):
                choice.text = "".join(parts[i])
                choice.finish_reason = finished.reason_of(i)
            return choices, finished

    reading = await until_client_leaves(upstream, read(), receive, keep_open=keep_open)
    if reading.cancelled():
        raise ClientClosedError("the client closed the connection before the answer was whole")
    return reading.result()
