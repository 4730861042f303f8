"""The gateway while its Redis is away: a clear 503, and a request that ends meanwhile is
still billed and gives its admission back.

Each test runs a redis-server of its own (tests/gateway/admission/test_outage.py) and
stops it at the moment under test; the real SmolLM2 node serves on loopback.
"""

from __future__ import annotations

import asyncio
import json
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
from tests.gateway.admission.test_outage import RedisServer
from tests.gateway.loopback import API_KEY, Node, running_node, start_gateway

pytestmark = pytest.mark.timeout(120)

AUTH = {"authorization": f"Bearer {API_KEY}"}
RUN = f"/client/v4/accounts/{ACCOUNT_ID}/ai/run/{SMOLLM2}"
UNAVAILABLE = "the service's shared store is unavailable; retry shortly"


def assert_store_unavailable(gateway_url: str) -> None:
    """A request in either dialect gets the 503 of a store that cannot serve, to retry in 2 s."""
    hi = {"prompt": "Hi", "max_tokens": 2, "temperature": 0}
    chat = {"model": SMOLLM2, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    wai = httpx.post(gateway_url + RUN, json=hi, headers=AUTH, timeout=30)
    oai = httpx.post(gateway_url + "/v1/chat/completions", json=chat, headers=AUTH, timeout=30)
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


def test_an_unreachable_redis_is_503_in_each_dialect_and_on_healthz(node, redis_server) -> None:
    prefix = f"test:outage-{uuid.uuid4().hex[:8]}:"

    async def add_key() -> None:
        client = aioredis.Redis.from_url(redis_server.url)
        await RedisKeyStore(client, prefix).add(API_KEY, ACCOUNT_ID)
        await client.aclose()

    asyncio.run(add_key())
    client = aioredis.Redis.from_url(redis_server.url)
    gateway = start_gateway(node, keys=RedisKeyStore(client, prefix), store_ping=client.ping)
    try:
        hi = {"prompt": "Hi", "max_tokens": 2, "temperature": 0}
        assert httpx.post(gateway.url + RUN, json=hi, headers=AUTH, timeout=60).status_code == 200
        health = httpx.get(gateway.url + "/healthz")
        assert (health.status_code, health.json()) == (200, {"status": "ok"})
        redis_server.stop()
        health = httpx.get(gateway.url + "/healthz")
        assert (health.status_code, health.json()) == (503, {"status": "store_unavailable"})
        time.sleep(1.1)  # past the key cache's second
        assert_store_unavailable(gateway.url)
        redis_server.start()  # the same port, empty: the key is gone, and says so
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


def test_a_store_demoted_to_a_read_only_replica_is_503_in_each_dialect(
    node, redis_server, tmp_path: Path
) -> None:
    """A failover leaves a gateway on the old master, now a replica: keys still read, every
    write (the limiter's, the reservation's) answers READONLY. The limiter "open" admits on
    this gateway's share; the reservation's READONLY must then be a 503 to retry, not a 500."""
    prefix = f"test-readonly-{uuid.uuid4().hex[:8]}:"
    client = aioredis.Redis.from_url(redis_server.url)
    asyncio.run(
        RedisKeyStore(aioredis.Redis.from_url(redis_server.url), prefix).add(API_KEY, ACCOUNT_ID)
    )
    settings = AdmissionSettings(on_redis_error="open", key_prefix=prefix.rstrip(":"))
    gateway = start_gateway(
        node,
        keys=RedisKeyStore(client, prefix),
        limiter=RedisLimiter(client, settings),
        reservations=RedisReservations(client, prefix),
        usage_sink=RedisUsageSink(client, f"{prefix}usage", tmp_path / "usage.journal"),
        store_ping=client.ping,
    )
    hi = {"prompt": "Hi", "max_tokens": 2, "temperature": 0}
    admin = redis.Redis.from_url(redis_server.url)
    try:
        assert httpx.post(gateway.url + RUN, json=hi, headers=AUTH, timeout=60).status_code == 200
        admin.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))  # a master never seen
        assert admin.info("replication")["role"] == "slave"
        assert_store_unavailable(gateway.url)
        # The store still answers PING (reads go on): the gateway stays in the balancer.
        assert httpx.get(gateway.url + "/healthz").status_code == 200
        admin.execute_command("REPLICAOF", "NO", "ONE")  # promoted: writes come back
        again = httpx.post(gateway.url + RUN, json=hi, headers=AUTH, timeout=60)
        assert again.status_code == 200, again.text
    finally:
        admin.close()
        gateway.stop()
