"""Workers AI's async batch in the gateway: the stores (in-process, and the real Redis), the
batch API's answers, and the worker's rules (low priority, retries, answers written once)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from gateway.admission import CapacityQueue
from gateway.app import create_app
from gateway.batch.store import BatchStore, LocalBatchStore, RedisBatchStore
from gateway.batch.worker import (
    BatchRequest,
    BatchWorker,
    Headroom,
    InteractiveTraffic,
    WorkerSettings,
)
from gateway.errors import BadRequestError, NoCapacityError
from gateway.keys import MemoryKeyStore
from gateway.settings import GatewaySettings
from scheduler.capacity import CapacityRecord, CapacityView, LocalCapacityRegistry
from scheduler.placement import LocalReservations, Placer
from tests.conftest import REDIS_URL, SMOLLM2

pytestmark = pytest.mark.timeout(60)

MODEL = SMOLLM2


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["local", "redis"])
async def store_of(
    request: pytest.FixtureRequest, redis_prefix: str
) -> AsyncIterator[Callable[..., BatchStore]]:
    """Builds the store under test: `store_of(retention_s=..., max_queued=..., claim_s=...)`."""
    client = aioredis.Redis.from_url(REDIS_URL)

    def build(retention_s: float = 60.0, max_queued: int = 8, claim_s: float = 30.0) -> Any:
        if request.param == "local":
            return LocalBatchStore(retention_s, max_queued)
        return RedisBatchStore(client, redis_prefix, retention_s, max_queued, claim_s)

    yield build
    await client.aclose()


def answer(index: int, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    return {"id": index, "result": {"response": f"r{index}", "usage": usage}, "success": True}


async def test_a_batch_is_queued_claimed_in_order_and_answered(store_of) -> None:
    store = store_of()
    batch_id = await store.submit("acct", MODEL, [{"prompt": "a"}, {"prompt": "b"}])
    assert batch_id is not None
    view = await store.get("acct", batch_id)
    assert view.result() == {"status": "queued", "request_id": batch_id, "model": MODEL}

    first = await store.claim("w1")
    assert (first.batch_id, first.index, first.body, first.attempt) == (
        batch_id, 0, {"prompt": "a"}, 1,
    )  # fmt: skip
    assert first.request_id == f"{batch_id}-0"
    assert (await store.get("acct", batch_id)).status == "queued"  # claimed, not yet sent
    await store.start(first)
    assert (await store.get("acct", batch_id)).status == "running"
    await store.complete(first, answer(0, 3, 2))
    second = await store.claim("w1")
    assert (second.index, second.request_id) == (1, f"{batch_id}-1")
    assert await store.claim("w1") is None
    await store.complete(second, answer(1, 4, 1))
    await store.complete(second, {"id": 1, "success": False})  # written once: the first stands

    assert (await store.get("acct", batch_id)).result() == {
        "responses": [answer(0, 3, 2), answer(1, 4, 1)],
        "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
    }


async def test_an_account_sees_only_its_own_batches(store_of) -> None:
    store = store_of()
    batch_id = await store.submit("acct", MODEL, [{"prompt": "a"}])
    assert await store.get("other", batch_id) is None
    assert await store.get("acct", str(uuid.uuid4())) is None
    assert await store.get("acct", f"x:{batch_id}") is None


async def test_the_queue_of_an_account_is_bounded_by_its_unanswered_requests(store_of) -> None:
    store = store_of(max_queued=3)
    assert await store.submit("acct", MODEL, [{}, {}]) is not None
    assert await store.submit("acct", MODEL, [{}, {}]) is None  # 4 > 3
    assert await store.submit("other", MODEL, [{}, {}, {}]) is not None  # each its own
    claim = await store.claim("w1")
    await store.complete(claim, answer(0, 1, 1))
    assert await store.submit("acct", MODEL, [{}, {}]) is not None  # 1 + 2


async def test_a_released_request_runs_again_as_a_new_attempt(store_of) -> None:
    store = store_of()
    batch_id = await store.submit("acct", MODEL, [{"prompt": "a"}])
    claim = await store.claim("w1")
    await store.release(claim)
    again = await store.claim("w2")
    assert (again.index, again.attempt, again.request_id) == (0, 2, f"{batch_id}-0-2")


async def test_answers_are_kept_for_the_retention_window(store_of) -> None:
    store = store_of(retention_s=0.3)
    batch_id = await store.submit("acct", MODEL, [{}])
    await store.complete(await store.claim("w1"), answer(0, 1, 1))
    assert (await store.get("acct", batch_id)).status == "done"
    await asyncio.sleep(0.4)
    assert await store.get("acct", batch_id) is None


async def test_a_claim_its_gateway_stopped_renewing_lapses_to_another(redis_prefix: str) -> None:
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        store = RedisBatchStore(client, redis_prefix, 60.0, 8, claim_s=0.3)
        await store.submit("acct", MODEL, [{"prompt": "a"}])
        dead = await store.claim("dead-gateway")
        assert await store.claim("live-gateway") is None  # held: not run twice
        await asyncio.sleep(0.2)
        await store.renew(dead)  # while renewed it stays held
        await asyncio.sleep(0.2)
        assert await store.claim("live-gateway") is None
        await asyncio.sleep(0.4)
        taken = await store.claim("live-gateway")
        assert (taken.index, taken.attempt, taken.consumer) == (0, 2, "live-gateway")
    finally:
        await client.aclose()


# -- the API ----------------------------------------------------------------------------

KEY, OTHER_KEY = "es-batch-key-a", "es-batch-key-b"
RUN = f"/client/v4/accounts/acct/ai/run/{MODEL}"


@pytest.fixture
async def api() -> AsyncIterator[httpx.AsyncClient]:
    """The gateway's app without its lifespan (no worker runs: batches stay queued)."""
    keys = MemoryKeyStore()
    await keys.add(KEY, "acct")
    await keys.add(OTHER_KEY, "other")
    settings = GatewaySettings(
        internal_token="internal", max_batch_requests=3, max_batch_queued_per_account=4
    )
    placer = Placer(CapacityView(LocalCapacityRegistry(), max_age_s=1.0), LocalReservations())
    app = create_app(settings, keys=keys, placer=placer)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        yield client


async def call(
    api: httpx.AsyncClient, body: Any, key: str = KEY, path: str = RUN
) -> httpx.Response:
    return await api.post(
        path,
        params={"queueRequest": "true"},
        json=body,
        headers={"authorization": f"Bearer {key}"},
    )


def error(code: int, message: str) -> dict[str, Any]:
    return {
        "result": None,
        "success": False,
        "errors": [{"code": code, "message": message}],
        "messages": [],
    }


async def test_a_batch_is_answered_at_once_and_polled_by_its_account(api) -> None:
    queued = await call(api, {"requests": [{"prompt": "a"}, {"prompt": "b"}]})
    assert queued.status_code == 200
    batch_id = queued.json()["result"]["request_id"]
    assert queued.json() == {
        "result": {"status": "queued", "request_id": batch_id, "model": MODEL},
        "success": True,
        "errors": [],
        "messages": [],
    }
    polled = await call(api, {"request_id": batch_id})
    assert (polled.status_code, polled.json()["result"]["status"]) == (200, "queued")

    theirs = await call(api, {"request_id": batch_id}, OTHER_KEY, RUN.replace("acct", "other"))
    missing = f"no queued request {batch_id!r} for this account"
    assert (theirs.status_code, theirs.json()) == (404, error(7003, missing))


async def test_the_batch_api_refuses_what_it_cannot_queue(api) -> None:
    too_many = await call(api, {"requests": [{}, {}, {}, {}]})
    assert too_many.status_code == 400
    assert too_many.json() == error(5004, "a batch holds at most 3 requests, got 4")
    neither = await call(api, {})
    assert neither.status_code == 400
    both = await call(api, {"requests": [{}], "request_id": "x"})
    assert both.status_code == 400
    empty = await call(api, {"requests": []})
    assert empty.status_code == 400

    assert (await call(api, {"requests": [{}, {}, {}]})).status_code == 200
    full = await call(api, {"requests": [{}, {}]})
    assert full.status_code == 429
    assert full.json()["errors"][0]["code"] == 3036
    assert full.headers["retry-after"] == "30"
    # another account's queue is its own
    theirs = await call(api, {"requests": [{}, {}]}, OTHER_KEY, RUN.replace("acct", "other"))
    assert theirs.status_code == 200


# -- the worker -------------------------------------------------------------------------


async def test_interactive_traffic_counts_posts_but_the_batch_apis() -> None:
    clock = Clock()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        assert traffic.num_in_flight == expected_in_flight
        clock.now += 1.0

    traffic = InteractiveTraffic(app, clock)
    assert traffic.idle_for() == 0.0  # just started
    clock.now += 2.0
    expected_in_flight = 1
    await traffic({"type": "http", "method": "POST", "query_string": b""}, None, None)
    assert traffic.idle_for() == 0.0
    clock.now += 0.5
    assert traffic.idle_for() == 0.5
    expected_in_flight = 0
    batch = {"type": "http", "method": "POST", "query_string": b"queueRequest=true"}
    await traffic(batch, None, None)
    await traffic({"type": "http", "method": "GET", "query_string": b""}, None, None)
    assert traffic.idle_for() == 2.5


def _record(load: float, num_waiting: int = 0) -> CapacityRecord:
    return CapacityRecord(
        "n1", "http://127.0.0.1:9", "mixed", ("smollm2",), 100, 100, 16, "fp32", 0,
        num_waiting, load, time.time(), 300.0, "fp32",
    )  # fmt: skip


async def test_a_batch_request_waits_for_room_then_runs_and_retries_what_passes() -> None:
    store = LocalBatchStore(60.0, 8)
    registry = LocalCapacityRegistry()
    await registry.publish(_record(load=0.9))
    placer = Placer(CapacityView(registry, max_age_s=0.0), LocalReservations())
    traffic = InteractiveTraffic(lambda *a: None, clock=lambda: 0.0)
    headroom = Headroom(traffic, CapacityQueue(), placer, idle_s=0.0, max_node_load=0.5)
    ran: list[str] = []

    async def run(request: BatchRequest) -> dict[str, Any]:
        ran.append(request.request_id)
        if len(ran) == 1:
            raise NoCapacityError("full")  # passes: runs again later
        if request.body == "bad":
            raise BadRequestError("the body must be a JSON object")
        return {"response": request.body["prompt"], "usage": {}}

    async def node_model(name: str) -> str | None:
        return "smollm2"

    settings = WorkerSettings(poll_s=0.01, retry_s=0.01)
    worker = BatchWorker(store, run, node_model, headroom, settings)
    batch_id = await store.submit(
        "acct", MODEL, [{"prompt": "a", "external_reference": "r"}, "bad"]
    )
    assert batch_id is not None
    worker.start()
    try:
        await asyncio.sleep(0.1)
        assert ran == []  # the node is loaded past max_node_load: nothing runs
        await registry.publish(_record(load=0.1))
        for _ in range(200):
            if (await store.get("acct", batch_id)).status == "done":
                break
            await asyncio.sleep(0.01)
    finally:
        await worker.aclose()
    assert ran == [f"{batch_id}-0", f"{batch_id}-0-2", f"{batch_id}-1"]
    assert (await store.get("acct", batch_id)).result()["responses"] == [
        {"id": 0, "external_reference": "r", "result": {"response": "a", "usage": {}},
         "success": True},
        {"id": 1, "result": None, "success": False,
         "errors": [{"code": 5004, "message": "the body must be a JSON object"}]},
    ]  # fmt: skip
