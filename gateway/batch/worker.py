"""The gateway's batch worker: queued requests run one at a time, when interactive traffic
leaves room, each through the dispatcher as any request (admitted, placed, metered).

Room means, all at once:
  - nobody waits in this gateway's capacity queue;
  - no interactive request has been in flight on this gateway for `idle_s`
    (`InteractiveTraffic` counts them: every POST but the batch API's own);
  - some live node serving the request's model has nobody waiting and a load under
    `max_node_load` (what other gateways' traffic leaves, as the nodes publish it).
A batch request never waits in the capacity queue (it is sent `reject_if_busy`): when a
node fills meanwhile it goes back to the queue and is tried again later.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

from redis.exceptions import RedisError
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.admission import CapacityQueue
from gateway.batch.store import BatchStore, Claim
from gateway.errors import (
    GatewayError,
    InternalError,
    NoCapacityError,
    NotReadyError,
    NotServedError,
    RateLimitedError,
    UnavailableError,
    UpstreamError,
    error_body,
)
from scheduler.placement import Placement, Placer

log = logging.getLogger(__name__)

# Refusals that pass: the request goes back to the queue and runs later.
TRANSIENT = (
    RateLimitedError,
    NoCapacityError,
    NotServedError,
    NotReadyError,
    UnavailableError,
    UpstreamError,
)


def is_batch_call(scope: Scope) -> bool:
    """A call of the batch API (`?queueRequest=true`): a submission or a poll."""
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    return any(v.lower() == "true" for v in query.get("queueRequest", ()))


class InteractiveTraffic:
    """Pure-ASGI middleware counting the interactive requests in flight (every POST but the
    batch API's), and how long the gateway has been without one."""

    def __init__(self, app: ASGIApp, clock: Callable[[], float] = time.monotonic) -> None:
        self.app = app
        self._clock = clock
        self.num_in_flight = 0
        self._last_end = clock()  # a gateway just started may be about to take traffic

    def idle_for(self) -> float:
        """Seconds since the last interactive request ended; 0 while one is in flight."""
        return 0.0 if self.num_in_flight else self._clock() - self._last_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or is_batch_call(scope):
            await self.app(scope, receive, send)
            return
        self.num_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.num_in_flight -= 1
            self._last_end = self._clock()


@dataclass(frozen=True)
class Headroom:
    """Whether interactive traffic leaves room for a batch request now (the module's rules)."""

    traffic: InteractiveTraffic
    queue: CapacityQueue[Placement]
    placer: Placer
    idle_s: float
    max_node_load: float

    def is_quiet(self) -> bool:
        return self.queue.num_waiting == 0 and self.traffic.idle_for() >= self.idle_s

    async def has_room(self, node_model: str) -> bool:
        if not self.is_quiet():
            return False
        return any(
            node_model in r.models and r.num_waiting == 0 and r.load < self.max_node_load
            for r in await self.placer.nodes()
        )


@dataclass(frozen=True)
class BatchRequest:
    """What the worker hands the Workers AI dialect to run: one request of a batch."""

    request_id: str
    account_id: str
    model: str
    body: Any


# Runs one request; its `result` (response and usage) or the GatewayError it met. Also
# the node model the request needs room on (None when its model is unknown: no room needed).
Runner = Callable[[BatchRequest], Awaitable[dict[str, Any]]]
ModelOf = Callable[[str], Awaitable[str | None]]


@dataclass(frozen=True)
class WorkerSettings:
    concurrency: int = 1  # batch requests this gateway runs at once
    poll_s: float = 0.1  # how often an idle worker looks for room and work
    claim_s: float = 30.0  # a claim its gateway stopped renewing lapses after this
    max_attempts: int = 5  # transient refusals before the refusal is the request's answer
    retry_s: float = 1.0  # back-off after a transient refusal or a store error
    # On stop, a request running is given this long to finish: one cut short is billed as
    # cancelled for the prompt its node ran, and runs (and is billed) again elsewhere.
    drain_s: float = 10.0


class BatchWorker:
    """Claims queued batch requests, runs each when `Headroom` allows, writes the answers."""

    def __init__(
        self,
        store: BatchStore,
        run: Runner,
        model_of: ModelOf,
        headroom: Headroom,
        settings: WorkerSettings,
    ) -> None:
        self._store = store
        self._run = run
        self._model_of = model_of
        self._headroom = headroom
        self._settings = settings
        self.consumer = f"gateway-{uuid.uuid4().hex[:12]}"
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()

    def start(self) -> None:
        self._stopping.clear()
        self._tasks = [
            asyncio.create_task(self._loop(), name=f"batch-worker-{i}")
            for i in range(self._settings.concurrency)
        ]

    async def aclose(self) -> None:
        """Stops the workers: a request running gets `drain_s` to finish, then is cancelled
        on its node and released; one waiting for room is released at once."""
        self._stopping.set()
        if self._tasks:
            _, running = await asyncio.wait(self._tasks, timeout=self._settings.drain_s)
            for task in running:
                task.cancel()
            for task in running:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._tasks = []

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    async def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                if not self._headroom.is_quiet():
                    await self._pause(self._settings.poll_s)
                    continue
                claim = await self._store.claim(self.consumer)
                if claim is None:
                    await self._pause(self._settings.poll_s)
                    continue
                await self._serve(claim)
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as exc:
                log.warning("batch worker %s: the store failed: %s", self.consumer, exc)
                await self._pause(self._settings.retry_s)
            except Exception:
                log.exception("batch worker %s failed", self.consumer)
                await self._pause(self._settings.retry_s)

    async def _serve(self, claim: Claim) -> None:
        renewing = asyncio.create_task(self._renew(claim))
        try:
            response = await self._answer(claim)
        except asyncio.CancelledError:
            await asyncio.shield(self._release(claim))
            raise
        finally:
            renewing.cancel()
            with contextlib.suppress(asyncio.CancelledError, RedisError, OSError):
                await renewing
        if response is None:
            await self._release(claim)
            await self._pause(self._settings.retry_s)
            return
        await self._store.complete(claim, response)

    async def _answer(self, claim: Claim) -> dict[str, Any] | None:
        """`claim`'s `responses` entry, or None to try it again later."""
        node_model = await self._model_of(claim.model)
        if node_model is not None:
            while not await self._headroom.has_room(node_model):
                if self._stopping.is_set():
                    return None
                await self._pause(self._settings.poll_s)
        request = BatchRequest(claim.request_id, claim.account_id, claim.model, claim.body)
        entry: dict[str, Any] = {"id": claim.index}
        if isinstance(claim.body, dict) and "external_reference" in claim.body:
            entry["external_reference"] = claim.body["external_reference"]
        await self._store.start(claim)
        try:
            result = await self._run(request)
        except TRANSIENT as exc:
            if claim.attempt < self._settings.max_attempts:
                log.info("batch request %s: %s; again later", claim.request_id, exc.message)
                return None
            return entry | _failed(exc)
        except GatewayError as exc:  # the request's own fault: its answer
            return entry | _failed(exc)
        except Exception:
            log.exception("batch request %s failed", claim.request_id)
            if claim.attempt < self._settings.max_attempts:
                return None
            return entry | _failed(InternalError("internal error"))
        return entry | {"result": result, "success": True}

    async def _renew(self, claim: Claim) -> None:
        while True:
            await asyncio.sleep(self._settings.claim_s / 3)
            await self._store.renew(claim)

    async def _release(self, claim: Claim) -> None:
        try:
            await self._store.release(claim)
        except (RedisError, OSError) as exc:  # it lapses after claim_s and runs then
            log.warning("could not release batch request %s: %s", claim.request_id, exc)


def _failed(error: GatewayError) -> dict[str, Any]:
    body = error_body(error, "workers_ai")
    return {"result": None, "success": False, "errors": body["errors"]}
