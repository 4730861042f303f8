"""One request's trip through the fleet: placed on a node, forwarded, and ended there.

`Dispatcher.open(job)` returns an `Upstream` whose first node event has already
arrived, so every failure a client can be told about with a status code
happens inside `open` (past the window, not admitted, no capacity, bad request per
the node, a node failing before its first token, which is retried once on another
node). `Upstream.events()` then relays the rest as it comes; `Upstream.close()`
always runs once: it cancels the request on the node if it did not finish and
releases the placement; gateway/metering.py settles its admission and usage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import httpx
from starlette.types import Receive

from common.node_api import (
    EmbedRequest,
    EmbedResponse,
    ErrorEvent,
    GenerateRequest,
    TokenChunk,
    read_event,
)
from common.telemetry import TelemetrySettings, setup_telemetry
from common.window import Window
from gateway.admission import CapacityQueue, Limiter, Placed
from gateway.catalog import CatalogModel, ServedModel
from gateway.errors import (
    BadRequestError,
    ClientClosedError,
    ContextWindowError,
    GatewayError,
    GrammarError,
    NoCapacityError,
    NotServedError,
    UpstreamError,
)
from gateway.jobs import EmbeddingJob, GenerationJob, Job
from gateway.liveness import NODE_GONE, NodeWatch
from gateway.metering import Meter, UsageSinkLike, estimate_tokens
from gateway.tracing import GenAISpan, GenAITracer
from gateway.upstream import (
    LEFT_BEFORE_ANSWER,
    Upstream,
    left_first,
    node_lines,
    unless_client_leaves,
)
from scheduler.placement import Placement, Placer
from scheduler.store_watch import StoreAway

log = logging.getLogger(__name__)

NO_CAPACITY_RETRY_S = 1.0
# What a client reads when a node fails (the node and its words go to the log and trace).
NODE_UNREACHABLE = "the node chosen for this request could not be reached; retry shortly"
NODE_FAILED = "the node serving this request failed; retry shortly"
NOT_SERVED_RETRY_S = 10.0  # a node restarting or being added takes this long at least
UPSTREAM_RETRY_S = 1.0  # a request no node could start: a dead node's record soon lapses
# A client that leaves while the node starts its request: how long the node may take to
# answer the cancel (it acts between engine steps) before the gateway stops waiting.
CANCEL_GRACE_S = 10.0


# Node error codes that mean "this request is wrong", answered as is; the rest are node trouble.
_CLIENT_ERRORS: dict[str, type[GatewayError]] = {
    "invalid_request": BadRequestError,
    "invalid_grammar": GrammarError,
    "request_too_large": ContextWindowError,
}


class Dispatcher:
    def __init__(
        self,
        client: httpx.AsyncClient,
        placer: Placer,
        internal_token: str,
        limiter: Limiter | None = None,
        usage_sink: UsageSinkLike | None = None,
        queue: CapacityQueue[Placement] | None = None,
        queue_deadline_s: float = 0.0,
        tracer: GenAITracer | None = None,
        node_silence_s: float = 5.0,
        node_probe_timeout_s: float = 5.0,
    ) -> None:
        self._client = client
        # Without a tracer of the caller's, GenAI metrics go to a registry nobody scrapes.
        self._tracer = tracer or GenAITracer(
            setup_telemetry(TelemetrySettings("edgeserve-gateway", is_tracing=False))
        )
        self._placer = placer
        self._auth = {"authorization": f"Bearer {internal_token}"}
        self.watch = NodeWatch(client, self._auth, placer, node_silence_s, node_probe_timeout_s)
        self._meter = Meter(limiter, usage_sink)
        # Without a queue a request that finds every node full is refused at once.
        self._queue = queue
        self._queue_deadline_s = queue_deadline_s

    async def open(self, job: GenerationJob, receive: Receive | None = None) -> Upstream:
        """Admits, places and starts `job`, until the node's first event. With the client's
        `receive`, a client that leaves ends it with ClientClosedError: while it waits in
        the capacity queue, it never reaches a node and is not billed; while the node starts
        it, it is cancelled there at once and billed as cancelled: the prompt tokens the node
        had processed, no output."""
        started_at = time.time()
        job = await self._fit_window(job)
        trace = self._tracer.start(job)
        try:
            headers = await self._meter.admit(job, trace)
        except BaseException as exc:
            trace.fail(exc)
            raise
        async with self._unless_refused(job, headers, trace):
            upstream = await self._place_and_connect(job, started_at, headers, trace, receive)
        if upstream.client_left:
            await upstream.close()  # billed as cancelled, its admission given back
            raise ClientClosedError(LEFT_BEFORE_ANSWER)
        return upstream

    async def record_start(self, upstream: Upstream) -> None:
        """A stream's durable start record: sent once its client has the status line, before
        the first token (docs/billing.md). A whole answer needs none: its end is recorded
        between its status line and its body (gateway.http.SettlingJSON)."""
        await self._meter.record_start(upstream)

    async def embed(
        self, job: EmbeddingJob, receive: Receive | None = None
    ) -> tuple[EmbedResponse, dict[str, str]]:
        """`job`'s vectors from a node serving its encoder, and admission's headers for the
        client: admitted, placed (waiting in the capacity queue as a generation does), run,
        retried once on another node when its node fails, and metered at the tokens the
        node encoded."""
        started_at = time.time()
        trace = self._tracer.start(job)
        try:
            headers = await self._meter.admit(job, trace)
        except BaseException as exc:
            trace.fail(exc)
            raise
        async with self._unless_refused(job, headers, trace):
            placement = await self._placed(job, trace, receive)
            try:
                response = await self._embed_on(placement, job, trace)
            except UpstreamError as exc:
                log.warning("embeddings %s: %s", job.request_id, exc.detail)
                retry = await self._place_elsewhere(job, placement.node_ids, trace)
                if retry is None:
                    exc.retry_after_s = exc.retry_after_s or UPSTREAM_RETRY_S
                    raise
                placement = retry
                response = await self._embed_on(placement, job, trace)
        if response.vectors:
            trace.span.set_attribute("gen_ai.embeddings.dimension.count", len(response.vectors[0]))
        await self._meter.settle_embedding(
            job, placement.node_id, started_at, response.prompt_tokens, trace
        )
        return response, headers

    async def _embed_on(
        self, placement: Placement, job: EmbeddingJob, trace: GenAISpan
    ) -> EmbedResponse:
        """The node's answer to `job`, its placement given back whatever happens;
        UpstreamError when the node is at fault (unreachable, failing, unresponsive)."""
        body = EmbedRequest(
            request_id=job.request_id,
            account_id=job.account_id,
            model=job.model.node_model,
            texts=job.texts,
            token_ids=job.token_ids,
            truncate=job.truncate,
        )
        sent_at = time.monotonic()
        call = asyncio.ensure_future(
            self._client.post(
                f"{placement.address}/internal/v1/embed",
                content=body.model_dump_json(exclude_defaults=True).encode(),
                headers=self._auth | {"content-type": "application/json"} | trace.traceparent(),
            )
        )
        watch = asyncio.ensure_future(self.watch.until_unresponsive(placement, lambda: sent_at))
        try:
            await asyncio.wait({call, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not call.done():
                detail = f"node {placement.node_id} {self.watch.silence}"
                raise UpstreamError(NODE_FAILED, detail=detail)
            response = call.result()
        except (httpx.HTTPError, OSError) as exc:
            if isinstance(exc, NODE_GONE):
                await self._placer.mark_down(placement.node_id)
            raise UpstreamError(
                NODE_UNREACHABLE, detail=f"node {placement.node_id} unreachable: {exc!r}"
            ) from None
        finally:
            for task in (call, watch):
                if not task.done():
                    task.cancel()
            await asyncio.gather(call, watch, return_exceptions=True)
            await self.release_placement(placement)
        if response.status_code != 200:
            code, message = _node_error(response)
            if code in _CLIENT_ERRORS:
                raise _CLIENT_ERRORS[code](message)
            raise UpstreamError(
                NODE_FAILED,
                detail=f"node {placement.node_id} answered {response.status_code}: {message}",
            )
        try:
            return EmbedResponse.model_validate_json(response.content)
        except ValueError as exc:
            raise UpstreamError(
                NODE_FAILED, detail=f"node {placement.node_id} answered no vectors: {exc}"
            ) from None

    @contextlib.asynccontextmanager
    async def _unless_refused(
        self, job: Job, headers: dict[str, str], trace: GenAISpan
    ) -> AsyncIterator[None]:
        """Around what follows admission: a refusal there (no node, bad input per the
        node, node failure) gives the admission back and ends the trace; the client still
        learns where its limits stand."""
        try:
            yield
        except GatewayError as exc:
            exc.headers = headers | exc.headers
            await self._meter.release(job, 0)
            trace.fail(exc)
            raise
        except BaseException as exc:
            await self._meter.release(job, 0)
            trace.fail(exc)
            raise

    async def _fit_window(self, job: GenerationJob) -> GenerationJob:
        """`job` with a default max_tokens shortened to what the window leaves; refused
        (ContextWindowError) when the client's own max_tokens leaves no room for a prompt:
        never servable, whatever the prompt, so not sent on to a rate limit."""
        payload = job.payload
        window = Window.of_context(await self.context_window(job.model))
        if payload.max_tokens_is_default:
            # The node shortens it further to what the prompt leaves; admission reserves this.
            max_tokens = window.fit_max_tokens(payload.max_tokens)
            if max_tokens != payload.max_tokens:
                payload = payload.model_copy(update={"max_tokens": max_tokens})
                job = replace(job, payload=payload, estimated_tokens=estimate_tokens(payload))
        refusal = window.refusal(
            payload.max_tokens,
            is_default=payload.max_tokens_is_default,
            max_tokens_name=job.max_tokens_name,
        )
        if refusal is not None:
            raise ContextWindowError(refusal, param=job.max_tokens_name)
        return job

    async def served_models(self) -> list[ServedModel]:
        """What the live nodes serve, as they publish it; none while the store is away (the
        catalog's own entries still resolve, and placement says what is wrong)."""
        try:
            served = await self._placer.served()
        except StoreAway:
            return []
        models = []
        for model, records in served.items():
            # An encoder's window is per input; the record's window and sampling defaults
            # are its node's generation model's.
            embedding_tokens = max(r.embedding_models.get(model, 0) for r in records)
            if embedding_tokens:
                models.append(ServedModel(model, {}, embedding_tokens, embedding_tokens))
            else:
                window = max(r.max_request_tokens for r in records)
                models.append(ServedModel(model, records[0].generation_defaults, window))
        return models

    async def context_window(self, model: CatalogModel) -> int:
        """`model`'s context window as the fleet serves it now: the catalog's, or less where
        the largest live node serving it takes no longer a request (its KV pool is smaller)."""
        if model.is_embedding:  # tokens per input, the model's own
            return model.context_window
        largest = await self._placer.max_request_tokens(model.node_model)
        return model.context_window if largest is None else min(model.context_window, largest)

    async def _place_and_connect(
        self,
        job: GenerationJob,
        started_at: float,
        headers: dict[str, str],
        trace: GenAISpan,
        receive: Receive | None = None,
    ) -> Upstream:
        placement = await self._placed(job, trace, receive)
        tried = set(placement.node_ids)  # a disaggregated placement's prefill node too
        retried = False
        while True:  # the first node, then one retry elsewhere
            try:
                return await self._connect(job, placement, started_at, headers, trace, receive)
            except UpstreamError as exc:
                log.warning("request %s: %s, before the first token", job.request_id, exc.detail)
                retry = None
                if not retried:
                    retried = True
                    retry = await self._place_elsewhere(job, frozenset(tried), trace)
                if retry is None:
                    # Nothing reached the client: it may try again at once.
                    exc.retry_after_s = exc.retry_after_s or UPSTREAM_RETRY_S
                    raise
                placement = retry
                tried |= placement.node_ids
            except BaseException:
                await self.release_placement(placement)
                raise

    async def _placed(self, job: Job, trace: GenAISpan, receive: Receive | None) -> Placement:
        """`_first_placement` under its span, a refusal counted as admission's."""
        with trace.step("placement"):
            try:
                placement = await self._first_placement(job, receive)
            except NoCapacityError:
                trace.rejected("no_capacity")
                raise
            except NotServedError:
                trace.rejected("not_served")
                raise
        trace.placed(placement)
        return placement

    async def _first_placement(self, job: Job, receive: Receive | None = None) -> Placement:
        """A node now, or after a fair wait in the capacity queue; NoCapacityError when every
        node serving the model stays full, NotServedError when none serves it, and
        ClientClosedError when the client (its `receive`) leaves while queued."""
        largest = await self._placer.largest_node_tokens(job.model.node_model)
        if not largest:
            # No live node serves the model at all: not a busy fleet that frees up in a
            # moment, so not the 429 that tells clients to retry shortly.
            raise NotServedError(
                f"no node serves {job.model.name} now", retry_after_s=NOT_SERVED_RETRY_S
            )
        # The estimate is an upper bound; when it exceeds every node's pool, reserve
        # the largest pool instead: the node counts the real tokens and answers
        # precisely (context window, pool size), and nothing waits for a placement
        # that could never come.
        num_tokens = min(job.estimated_tokens, largest)

        async def try_place() -> Placement | None:
            return await self._placer.place(
                job.model.node_model,
                job.request_id,
                num_tokens,
                account_id=job.account_id,
                session_id=job.session_id,
            )

        # Some node serves the model and may free up: with a queue, wait in it fairly.
        if self._queue is None:
            placement = await try_place()
            if placement is not None:
                return placement
            detail = ""
        else:
            # Room now: nothing to wait for, nor to watch (a client that has just left is
            # still served, and billed, as it would be without a queue).
            if self._queue.num_waiting == 0 and (placement := await try_place()) is not None:
                return placement
            waiting = self._queue.wait(
                job.account_id,
                try_place,
                deadline_s=self._queue_deadline_s,
                reject_if_busy=job.reject_if_busy,
                on_abandoned=self.release_placement,
            )
            # While it waits, a client that gives up leaves the queue at once, its admission
            # given back, rather than holding its place (and a node's time) to the deadline.
            outcome = await (waiting if receive is None else unless_client_leaves(waiting, receive))
            if isinstance(outcome, Placed):
                return outcome.placement
            detail = {
                "busy": " (every node is busy)",
                "queue_full": " (every node is busy and the wait queue is full)",
                "deadline": f" (every node stayed busy for {self._queue_deadline_s:g}s)",
            }[outcome.reason]
        raise NoCapacityError(
            f"no capacity for {job.model.name} right now{detail}; retry shortly",
            retry_after_s=NO_CAPACITY_RETRY_S,
        )

    async def reconnect(self, upstream: Upstream) -> Upstream | None:
        """`upstream`'s request started again on another node, its placement given back:
        for a whole answer whose node failed before anything reached the client. None when
        no other node can take it now or the new one fails too before its first event."""
        job, failed = upstream.job, upstream.placement
        await self.release_placement(failed)
        placement = await self._place_elsewhere(job, failed.node_ids, upstream.trace)
        if placement is None:
            return None
        try:
            return await self._connect(
                job, placement, upstream.started_at, upstream.headers, upstream.trace
            )
        except UpstreamError as exc:  # _connect gave the placement back
            log.warning("request %s: %s, on its second node", job.request_id, exc.detail)
            return None
        except GatewayError:  # the node refused it as the client's fault, and it went back
            raise
        except BaseException:
            # Cancelled (the client left, the gateway stops): the second node's reservation
            # goes back with it.
            await asyncio.shield(self.release_placement(placement))
            raise

    async def _place_elsewhere(
        self, job: Job, exclude: frozenset[str], trace: GenAISpan
    ) -> Placement | None:
        """A placement for `job` on none of the nodes in `exclude`, or None."""
        with trace.step("placement"):
            placement = await self._placer.place(
                job.model.node_model,
                job.request_id,
                job.estimated_tokens,
                exclude=exclude,
                account_id=job.account_id,
                session_id=job.session_id,
            )
        if placement is not None:
            trace.placed(placement)
        return placement

    async def release_placement(self, placement: Placement) -> None:
        """Gives a node reservation back and lets the capacity queue try its waiters."""
        await self._placer.release(placement)
        if self._queue is not None:
            self._queue.notify()

    async def _connect(
        self,
        job: GenerationJob,
        placement: Placement,
        started_at: float,
        headers: dict[str, str],
        trace: GenAISpan,
        receive: Receive | None = None,
    ) -> Upstream:
        """POST to the node and wait for its first event; UpstreamError when the node is at fault.

        A disaggregated placement names the prefill node, whose KV the decode node fetches.
        With the client's `receive`, a client that leaves meanwhile has the request cancelled
        on the node at once (rather than after its whole prompt has run): the Upstream then
        comes back marked `client_left`, or ClientClosedError when the node never started it."""
        body = _node_body(job, placement.prefill_address)
        request = self._client.build_request(
            "POST",
            f"{placement.address}/internal/v1/generate",
            content=body.model_dump_json(exclude_defaults=True).encode(),
            headers=self._auth | {"content-type": "application/json"} | trace.traceparent(),
        )
        starting = asyncio.ensure_future(self._start_watched(request, placement))
        try:
            if receive is not None and await left_first(starting, receive):
                return await self._left_while_starting(
                    job, placement, starting, started_at, headers, trace
                )
            response, lines, first = await starting
        except (httpx.HTTPError, StopAsyncIteration, ValueError) as exc:
            await self.release_placement(placement)
            if isinstance(exc, NODE_GONE):
                await self._placer.mark_down(placement.node_id)
            raise UpstreamError(
                NODE_UNREACHABLE, detail=f"node {placement.node_id} unreachable: {exc!r}"
            ) from None
        except UpstreamError:
            await self.release_placement(placement)
            raise
        except asyncio.CancelledError:
            # Cancelled (the gateway stops) while the node starts the request: tell the node,
            # which would otherwise run the whole prompt before it noticed.
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            await asyncio.shield(self._cancel_on_node(placement, job.request_id))
            raise
        return Upstream(self, job, placement, response, lines, first, started_at, headers, trace)

    async def _start_watched(
        self, request: httpx.Request, placement: Placement
    ) -> tuple[httpx.Response, AsyncIterator[str], TokenChunk]:
        """`_start`, failed with UpstreamError (so retried elsewhere) when the node goes
        unresponsive before its first event (NodeWatch.until_unresponsive)."""
        sent_at = time.monotonic()
        start = asyncio.ensure_future(self._start(request, placement))
        watch = asyncio.ensure_future(self.watch.until_unresponsive(placement, lambda: sent_at))
        try:
            await asyncio.wait({start, watch}, return_when=asyncio.FIRST_COMPLETED)
            if start.done():
                return start.result()
            detail = f"node {placement.node_id} {self.watch.silence}"
            raise UpstreamError(NODE_FAILED, detail=detail)
        finally:
            for task in (start, watch):
                if not task.done():
                    task.cancel()
            await asyncio.gather(start, watch, return_exceptions=True)

    async def _start(
        self, request: httpx.Request, placement: Placement
    ) -> tuple[httpx.Response, AsyncIterator[str], TokenChunk]:
        """The node's response, its lines and its first event; the response is closed when
        anything goes wrong (a refusal the client caused gives the placement back too)."""
        response = await self._client.send(request, stream=True)
        try:
            if response.status_code != 200:
                await response.aread()
                code, message = _node_error(response)
                if code in _CLIENT_ERRORS:
                    await self.release_placement(placement)
                    raise _CLIENT_ERRORS[code](message)
                raise UpstreamError(
                    NODE_FAILED,
                    detail=f"node {placement.node_id} answered {response.status_code}: {message}",
                )
            lines = node_lines(response)
            first_line = ""
            while not first_line:
                first_line = await anext(lines)
            first = read_event(first_line)
            if not isinstance(first, TokenChunk):
                what = first.error.message if isinstance(first, ErrorEvent) else "no first token"
                raise UpstreamError(NODE_FAILED, detail=f"node {placement.node_id} failed: {what}")
            return response, lines, first
        except BaseException:
            await response.aclose()
            raise

    async def _left_while_starting(
        self,
        job: GenerationJob,
        placement: Placement,
        starting: asyncio.Future[tuple[httpx.Response, AsyncIterator[str], TokenChunk]],
        started_at: float,
        headers: dict[str, str],
        trace: GenAISpan,
    ) -> Upstream:
        """The client left while the node starts its request: cancel it there, and take the
        node's answer (its cancelled end, or a first token that beat the cancel) as an
        Upstream marked `client_left`, so the request is billed as any cancelled one.
        ClientClosedError when the node never started it (the placement is the caller's
        to give back)."""
        await self._cancel_on_node(placement, job.request_id)
        try:
            response, lines, first = await asyncio.wait_for(starting, CANCEL_GRACE_S)
        except Exception:
            # Refused (a cancel that arrived first), unreachable or too slow: nothing ran
            # that reached the client, and nothing is billed.
            raise ClientClosedError(LEFT_BEFORE_ANSWER) from None
        upstream = Upstream(
            self, job, placement, response, lines, first, started_at, headers, trace
        )
        upstream.client_left = True
        return upstream

    async def finish(self, upstream: Upstream) -> None:
        job, placement = upstream.job, upstream.placement
        try:
            if not upstream.is_released:
                if not upstream.is_finished and not upstream.client_left:  # else cancelled
                    await self._cancel_on_node(placement, job.request_id)
                await self.release_placement(placement)
        finally:
            # Whatever failed above, the request is metered and its admission given back.
            await self._meter.settle(upstream)

    async def _cancel_on_node(self, placement: Placement, request_id: str) -> None:
        try:
            await self._client.delete(
                f"{placement.address}/internal/v1/requests/{request_id}",
                headers=self._auth,
                timeout=2.0,
            )
        except httpx.HTTPError:
            # The node is gone or busy; closing the stream also aborts the request there.
            log.warning("could not cancel %s on node %s", request_id, placement.node_id)


def _node_body(job: GenerationJob, prefill_from: str | None = None) -> GenerateRequest:
    """The node's generate call for `job`."""
    return GenerateRequest(
        request_id=job.request_id,
        account_id=job.account_id,
        model=job.model.node_model,
        prefill_from=prefill_from,
        **dict(job.payload),
    )


def _node_error(response: httpx.Response) -> tuple[str, str]:
    try:
        error = ErrorEvent.model_validate_json(response.content).error
    except ValueError:
        return "internal", response.text[:200]
    return error.code, error.message
