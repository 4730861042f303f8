"""A fleet gateway's Redis stores (`redis_stores`): every key under the gateway's prefix, and
one watch over Redis, so the first call that finds it away degrades them all at once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from gateway.admission import AdmissionSettings, Limits
from gateway.settings import GatewaySettings
from gateway.stores import RedisStores, redis_stores
from scheduler.capacity import CapacityRecord
from scheduler.store_watch import StoreAway
from tests.redis_server import RedisServer

pytestmark = pytest.mark.timeout(60)


def _record(node_id: str) -> CapacityRecord:
    return CapacityRecord(
        node_id, "http://127.0.0.1:9", "mixed", ("smollm2",), 1000, 1000, 16, "fp32", 0, 0, 0.0,
        time.time(), 300.0, "fp32",
    )  # fmt: skip


@pytest.fixture
async def fleet() -> AsyncIterator[tuple[RedisServer, aioredis.Redis, RedisStores]]:
    server = RedisServer()
    server.start()
    client = aioredis.Redis.from_url(server.url)
    settings = GatewaySettings(internal_token="internal", capacity_max_age_s=0.01)
    # A long retry: once away, no call tries Redis again during the test.
    admission = AdmissionSettings(key_prefix="es", redis_timeout_s=1.0, redis_retry_s=60.0)
    yield server, client, redis_stores(client, settings, admission, "es:")
    await client.aclose()
    server.stop()


async def test_every_store_writes_under_the_gateways_prefix(fleet) -> None:
    _, client, stores = fleet
    key = await stores.keys.create("acct")
    assert await stores.keys.lookup(key) == "acct"
    await stores.registry.publish(_record("n1"))
    assert [r.node_id for r in await stores.placer.nodes()] == ["n1"]
    await stores.limit_store.save("acct", Limits(requests_per_minute=5))
    assert (await stores.limiter.acquire("acct", "smollm2", "r1", 10)).admitted
    names = {k.decode() async for k in client.scan_iter(match="*")}
    assert names and all(n.startswith("es:") for n in names), names
    assert "es:limits:acct" in names


async def test_the_first_call_that_finds_redis_away_degrades_every_store(fleet) -> None:
    server, _, stores = fleet
    known = await stores.keys.create("acct")
    assert await stores.keys.lookup(known) == "acct"  # confirmed: known while Redis is away
    await stores.registry.publish(_record("n1"))
    assert [r.node_id for r in await stores.placer.nodes()] == ["n1"]
    assert not stores.watch.is_away

    server.freeze()  # a call that asks it now waits out its timeout (1 s)
    with pytest.raises(StoreAway):
        await stores.keys.lookup("es-a-key-nobody-confirmed")  # cannot be checked: a 503
    assert stores.watch.is_away
    await asyncio.sleep(0.05)  # past the capacity view's cache: it would ask Redis now
    started = time.monotonic()
    assert [r.node_id for r in await stores.placer.nodes()] == ["n1"]  # last-known
    assert await stores.keys.lookup(known) == "acct"
    answer = await stores.limiter.acquire("acct", "smollm2", "r1", 10)  # this gateway's share
    assert answer.admitted and stores.limiter.is_degraded
    assert time.monotonic() - started < 0.9  # none of them waited on the frozen store
