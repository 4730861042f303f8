"""The gateway while its Redis is away: keys it confirmed recently are still served (the
last-known capacity, local reservations and limits), any other key is a clear 503, a
request that ends meanwhile is still billed and gives its admission back, and nothing stays
reserved once Redis returns.

Each test runs a redis-server of its own (tests/redis_server.py) and
stops it at the moment under test; the real SmolLM2 node serves on loopback.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio as aioredis

from billing.sink import RedisUsageSink
from gateway.admission import AdmissionSettings, LimitPolicy, Limits, RedisLimiter
from gateway.keys import RedisKeyStore
from scheduler.placement import RedisReservations
from tests.conftest import ACCOUNT_ID, SMOLLM2, free_port
from tests.loopback import API_KEY, OTHER_KEY, Node, running_node, start_gateway
from tests.redis_server import RedisServer

pytestmark = pytest.mark.timeout(120)

AUTH = {"authorization": f"Bearer {API_KEY}"}
OTHER_AUTH = {"authorization": f"Bearer {OTHER_KEY}"}
RUN = f"/client/v4/accounts/{ACCOUNT_ID}/ai/run/{SMOLLM2}"
UNAVAILABLE = "the service's shared store is unavailable; retry shortly"


def assert_store_unavailable(gateway_url: str, auth: dict[str, str]) -> None:
    """A request in either dialect gets the 503 of a store that cannot serve, to retry in 2 s."""
    hi = {"prompt": "Hi", "max_tokens": 2, "temperature": 0}
    chat = {"model": SMOLLM2, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    wai = httpx.post(gateway_url + RUN, json=hi, headers=auth, timeout=30)
    oai = httpx.post(gateway_url + "/v1/chat/completions", json=chat, headers=auth, timeout=30)
    assert (wai.status_code, wai.headers["retry-after"], wai.json()) == (
        503,
        "2",
        {
            "result": None,
            "success": False,
            "errors": [{"code": 7010, "message": UNAVAILABLE}],
            "messages": [],
        },
    )
    assert (oai.status_code, oai.headers["retry-after-ms"], oai.json()) == (
        503,
        "2000",
        {
            "error": {
                "message": UNAVAILABLE,
                "type": "server_error",
                "param": None,
                "code": "service_unavailable",
            }
        },
    )


@pytest.fixture(scope="module")
def node(engine: Any) -> Iterator[Node]:
    yield from running_node(engine)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    yield server
    server.stop()


def test_while_redis_is_unreachable_a_known_key_is_served_and_another_is_503(
    node, redis_server
) -> None:
    prefix = f"test:outage-{uuid.uuid4().hex[:8]}:"

    async def add_keys() -> None:
        client = aioredis.Redis.from_url(redis_server.url)
        await RedisKeyStore(client, prefix).add(API_KEY, ACCOUNT_ID)
        await RedisKeyStore(client, prefix).add(OTHER_KEY, ACCOUNT_ID)
        await client.aclose()

    asyncio.run(add_keys())
    client = aioredis.Redis.from_url(redis_server.url)
    gateway = start_gateway(node, keys=RedisKeyStore(client, prefix), store_ping=client.ping)
    try:
        hi = {"prompt": "Hi", "max_tokens": 2, "temperature": 0}
        assert httpx.post(gateway.url + RUN, json=hi, headers=AUTH, timeout=60).status_code == 200
        health = httpx.get(gateway.url + "/healthz")
        assert (health.status_code, health.json()) == (200, {"status": "ok"})
        redis_server.stop()
        health = httpx.get(gateway.url + "/healthz")
        assert (health.status_code, health.json()) == (
            200,
            {"status": "degraded", "store": "unavailable"},
        )
        time.sleep(1.1)  # past the key cache's second: the known keys' table answers
        assert httpx.post(gateway.url + RUN, json=hi, headers=AUTH, timeout=60).status_code == 200
        assert_store_unavailable(gateway.url, OTHER_AUTH)  # never seen by this gateway
        redis_server.start()  # the same port, empty: the key is gone, and says so
        time.sleep(1.1)  # past the store watch's retry: the next lookup asks Redis
        again = httpx.post(gateway.url + RUN, json=hi, headers=AUTH, timeout=60)
        assert again.status_code == 401
    finally:
        gateway.stop()


def test_a_stream_that_ends_while_redis_is_away_is_journaled_and_frees_its_slot(
    node, redis_server, tmp_path: Path
) -> None:
    """Reservation, admission lease and usage event all live in Redis. Redis stops mid-stream:
    the client still gets the whole answer, its usage event goes to the journal with the
    tokens the client saw, and the account's one concurrency slot is free again once the
    lease lapses (a failed release had kept it renewed for good, locking the account out)."""
    prefix = f"test-outage-{uuid.uuid4().hex[:8]}"
    settings = AdmissionSettings(
        policy=LimitPolicy(default=Limits(max_concurrent=1)),
        redis_timeout_s=0.5,
        redis_retry_s=0.3,
        lease_s=1.5,
        heartbeat_s=0.5,
        key_prefix=prefix,
    )
    client = aioredis.Redis.from_url(redis_server.url)
    journal = tmp_path / "usage.journal"
    gateway = start_gateway(
        node,
        limiter=RedisLimiter(client, settings),
        reservations=RedisReservations(client, f"{prefix}:"),
        usage_sink=RedisUsageSink(client, f"{prefix}:usage", journal),
    )
    try:
        body = {"prompt": "1, 2, 3, 4, 5,", "raw": True, "temperature": 0, "max_tokens": 24}
        events = []
        with httpx.stream(
            "POST", gateway.url + RUN, json=body | {"stream": True}, headers=AUTH, timeout=60
        ) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                if len(events) == 2:
                    redis_server.stop()
                events.append(line.removeprefix("data: "))
        assert events[-1] == "[DONE]"
        usage = json.loads(events[-2])["usage"]
        assert usage["completion_tokens"] == 24
        deadline = time.monotonic() + 10
        while not journal.exists() or not journal.read_text():
            assert time.monotonic() < deadline, "no usage event was journaled"
            time.sleep(0.05)
        [line] = journal.read_text().splitlines()
        event = json.loads(line)
        assert (event["account_id"], event["status"]) == (ACCOUNT_ID, "ok")
        # the stream entry's fields, as XADD takes them: strings
        assert (int(event["input_tokens"]), int(event["output_tokens"])) == (
            usage["prompt_tokens"],
            usage["completion_tokens"],
        )

        redis_server.start()
        time.sleep(settings.lease_s + 2 * settings.heartbeat_s)
        again = httpx.post(gateway.url + RUN, json=body, headers=AUTH, timeout=60)
        assert again.status_code == 200, again.text
    finally:
        gateway.stop()


def test_a_store_demoted_to_a_read_only_replica_still_serves_known_keys(
    node, redis_server, tmp_path: Path
) -> None:
    """A failover leaves a gateway on the old master, now a replica: keys still read, every
    write (the limiter's, the reservation's, the usage stream's) answers READONLY. The
    gateway serves as while Redis is away: the limiter's local share, this gateway's own
    reservations, the usage journal; once promoted, Redis holds the reservations again."""
    prefix = f"test-readonly-{uuid.uuid4().hex[:8]}:"
    client = aioredis.Redis.from_url(redis_server.url)
    asyncio.run(
        RedisKeyStore(aioredis.Redis.from_url(redis_server.url), prefix).add(API_KEY, ACCOUNT_ID)
    )
    settings = AdmissionSettings(on_redis_error="open", key_prefix=prefix.rstrip(":"))
    reservations = RedisReservations(client, prefix)
    journal = tmp_path / "usage.journal"
    gateway = start_gateway(
        node,
        keys=RedisKeyStore(client, prefix),
        limiter=RedisLimiter(client, settings),
        reservations=reservations,
        usage_sink=RedisUsageSink(client, f"{prefix}usage", journal),
        store_ping=client.ping,
    )
    hi = {"prompt": "Hi", "max_tokens": 2, "temperature": 0}
    admin = redis.Redis.from_url(redis_server.url)
    try:
        assert httpx.post(gateway.url + RUN, json=hi, headers=AUTH, timeout=60).status_code == 200
        admin.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))  # a master never seen
        assert admin.info("replication")["role"] == "slave"
        during = httpx.post(gateway.url + RUN, json=hi, headers=AUTH, timeout=60)
        assert during.status_code == 200, during.text
        assert len(journal.read_text().splitlines()) == 1  # its usage, journaled
        # The store still answers PING (reads go on): the gateway stays in the balancer.
        assert httpx.get(gateway.url + "/healthz").status_code == 200
        admin.execute_command("REPLICAOF", "NO", "ONE")  # promoted: writes come back
        time.sleep(1.1)  # past the store watch's retry
        again = httpx.post(gateway.url + RUN, json=hi, headers=AUTH, timeout=60)
        assert again.status_code == 200, again.text
        assert admin.hlen(f"{prefix}resv:node-1") == 0  # released in Redis, nothing left
    finally:
        admin.close()
        gateway.stop()


# The outage of the load test (EDGESERVE_OUTAGE_S to choose another).
OUTAGE_S = float(os.environ.get("EDGESERVE_OUTAGE_S", "10"))
NUM_CLIENTS = 4


@pytest.mark.timeout(180)
def test_known_keys_are_served_through_a_redis_outage_and_nothing_stays_reserved(
    engine, redis_server, tmp_path: Path
) -> None:
    """Redis frozen for OUTAGE_S under load from a known key, with a node whose record
    lives 1 s: at least 99% of the requests succeed (the last-known record, local
    reservations, the local share of the limits), an unknown key is a 503, and once Redis
    is back no reservation outlives the requests by 10 s and every 200 has exactly one
    ledger row with the tokens its client was told."""
    from billing.ledger import open_ledger
    from billing.worker import BillingWorker, WorkerConfig
    from gateway.app import create_app
    from gateway.settings import GatewaySettings
    from gateway.stores import redis_stores
    from gpu_node.server import NodeService, NodeSettings, create_node_app
    from scheduler.capacity import RedisCapacityRegistry
    from tests.conftest import INTERNAL_TOKEN, ServerThread

    prefix = f"test-load-{uuid.uuid4().hex[:8]}:"
    stream = f"{prefix}usage"
    asyncio.run(add_key(redis_server.url, prefix))
    node_port = free_port()
    node_settings = NodeSettings(
        node_id="node-1", address=f"http://127.0.0.1:{node_port}", internal_token=INTERNAL_TOKEN,
        heartbeat_s=0.2, ttl_s=1.0, registry_timeout_s=0.5,
    )  # fmt: skip
    node_registry = RedisCapacityRegistry(aioredis.Redis.from_url(redis_server.url), prefix)
    service = NodeService(node_settings, node_registry, engine=engine)
    node = ServerThread(create_node_app(service), node_port).start()

    client = aioredis.Redis.from_url(redis_server.url)
    admission = AdmissionSettings(
        key_prefix=prefix.rstrip(":"), redis_timeout_s=0.25, redis_retry_s=0.5,
        heartbeat_s=0.5, lease_s=1.5,
    )  # fmt: skip
    settings = GatewaySettings(internal_token=INTERNAL_TOKEN, capacity_max_age_s=0.2)
    stores = redis_stores(client, settings, admission, prefix)
    sink = RedisUsageSink(client, stream, tmp_path / "usage.journal")
    gateway = ServerThread(
        create_app(
            settings, keys=stores.keys, placer=stores.placer, limiter=stores.limiter,
            usage_sink=sink, on_startup=sink.start, on_shutdown=sink.aclose,
        )
    ).start()  # fmt: skip
    answers: list[tuple[float, int, str, int]] = []  # (at, status, request id, output tokens)

    async def one_client(http: httpx.AsyncClient, until: float) -> None:
        body = {"prompt": "1, 2, 3,", "raw": True, "temperature": 0, "max_tokens": 3}
        while time.monotonic() < until:
            r = await http.post(RUN, json=body, headers=AUTH)
            tokens = r.json()["result"]["usage"]["completion_tokens"] if r.status_code == 200 else 0
            answers.append((time.monotonic(), r.status_code, r.headers["x-request-id"], tokens))

    async def load() -> float:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
            start = time.monotonic()
            until = start + 1.5 + OUTAGE_S + 3.0
            clients = asyncio.gather(*(one_client(http, until) for _ in range(NUM_CLIENTS)))
            await asyncio.sleep(1.5)
            redis_server.freeze()
            await asyncio.sleep(OUTAGE_S / 2)
            unknown = await http.post(RUN, json={"prompt": "Hi"}, headers={
                "authorization": "Bearer es-a-key-never-issued"})  # fmt: skip
            assert (unknown.status_code, unknown.json()["errors"][0]["code"]) == (503, 7010)
            await asyncio.sleep(OUTAGE_S / 2)
            redis_server.thaw()
            await clients
            return start

    try:
        start = asyncio.run(load())
        ended = time.monotonic()
        statuses = [status for _, status, _, _ in answers]
        during = [s for at, s, _, _ in answers if start + 1.5 <= at < start + 1.5 + OUTAGE_S]
        assert len(during) >= NUM_CLIENTS, f"too few requests during the outage: {during}"
        assert statuses.count(200) >= 0.99 * len(statuses), sorted(set(statuses))

        async def reserved() -> int:  # by every gateway, as Redis holds them
            table = aioredis.Redis.from_url(redis_server.url)
            try:
                return await RedisReservations(table, prefix).reserved_tokens("node-1")
            finally:
                await table.aclose()

        while (held := asyncio.run(reserved())) > 0:
            assert time.monotonic() - ended < 10.0, f"{held} tokens still reserved"
            time.sleep(0.2)

        deadline = time.monotonic() + 30
        while not sink.journal.is_empty():
            assert time.monotonic() < deadline, "the journal was never replayed"
            time.sleep(0.1)
        ledger = open_ledger(tmp_path / "ledger.sqlite3")

        async def bill() -> None:
            billing = aioredis.Redis.from_url(redis_server.url)
            worker = BillingWorker(billing, ledger, WorkerConfig(stream_key=stream, block_ms=10))
            await worker.ensure_group()
            while (batch := await worker.read_once()).num_new + batch.num_duplicate:
                pass
            await billing.aclose()

        asyncio.run(bill())
        served = {rid: tokens for _, status, rid, tokens in answers if status == 200}
        rows = ledger.rows(served)
        assert ledger.count() == len(served)
        assert {rid: (row.status, row.output_tokens) for rid, row in rows.items() if row} == {
            rid: ("ok", tokens) for rid, tokens in served.items()
        }
        ledger.close()
    finally:
        gateway.stop()
        node.stop()


async def add_key(url: str, prefix: str) -> None:
    client = aioredis.Redis.from_url(url)
    await RedisKeyStore(client, prefix).add(API_KEY, ACCOUNT_ID)
    await client.aclose()
