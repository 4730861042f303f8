from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace

import pytest

from scheduler.capacity import (
    CapacityRecord,
    CapacityView,
    LocalCapacityRegistry,
    RedisCapacityRegistry,
    load_estimate,
)


def record(
    node_id: str, *, ttl_s: float = 5.0, published_at: float | None = None, models=("smollm2",)
) -> CapacityRecord:
    return CapacityRecord(
        node_id=node_id,
        address=f"http://127.0.0.1:9{node_id[-1]}00",
        role="mixed",
        models=models,
        num_pages=64,
        num_free_pages=48,
        page_size=16,
        kv_dtype="fp8",
        num_running=2,
        num_waiting=1,
        load=0.25,
        published_at=time.time() if published_at is None else published_at,
        ttl_s=ttl_s,
        activations="bf16",
    )


def test_record_round_trips_through_json() -> None:
    r = record("node-1", published_at=1700000000.5)
    assert CapacityRecord.from_json(r.to_json()) == r
    assert r.num_free_tokens == 768
    assert r.num_total_tokens == 1024


def test_a_record_from_before_activations_reads_as_its_own_kind() -> None:
    fields = json.loads(record("node-1").to_json())
    del fields["activations"]
    old = CapacityRecord.from_json(json.dumps(fields))
    assert old.activations == "unknown" and old.kv_kind == ("fp8", "unknown")


def test_a_record_from_before_max_request_tokens_says_none() -> None:
    r = replace(record("node-1"), max_request_tokens=5824)
    assert CapacityRecord.from_json(r.to_json()).max_request_tokens == 5824
    fields = json.loads(r.to_json())
    del fields["max_request_tokens"]
    assert CapacityRecord.from_json(json.dumps(fields)).max_request_tokens == 0


def test_a_record_carries_the_models_sampling_defaults() -> None:
    r = replace(record("node-1"), generation_defaults={"temperature": 0.7, "top_p": 0.8})
    assert CapacityRecord.from_json(r.to_json()).generation_defaults == {
        "temperature": 0.7,
        "top_p": 0.8,
    }
    fields = json.loads(r.to_json())
    del fields["generation_defaults"]
    assert CapacityRecord.from_json(json.dumps(fields)).generation_defaults == {}


def test_record_is_live_until_its_ttl_passes() -> None:
    r = record("node-1", ttl_s=2.0, published_at=100.0)
    assert r.is_live(101.999)
    assert not r.is_live(102.0)


def test_load_estimate_counts_the_pool_then_the_queue() -> None:
    assert load_estimate(num_pages=100, num_free_pages=100, num_waiting=0, max_num_seqs=8) == 0.0
    assert load_estimate(num_pages=100, num_free_pages=25, num_waiting=0, max_num_seqs=8) == 0.75
    assert load_estimate(num_pages=100, num_free_pages=0, num_waiting=4, max_num_seqs=8) == 1.5


async def test_local_registry_lists_live_records_in_node_order() -> None:
    now = [1000.0]
    registry = LocalCapacityRegistry(clock=lambda: now[0])
    await registry.publish(record("node-2", published_at=1000.0, ttl_s=1.0))
    await registry.publish(record("node-1", published_at=1000.0, ttl_s=3.0))
    assert [r.node_id for r in await registry.list_live()] == ["node-1", "node-2"]
    now[0] = 1001.5
    assert [r.node_id for r in await registry.list_live()] == ["node-1"]
    await registry.remove("node-1")
    assert await registry.list_live() == []


async def test_redis_registry_expires_a_node_that_stops_publishing(
    redis_client, redis_prefix
) -> None:
    registry = RedisCapacityRegistry(redis_client, prefix=redis_prefix)
    # 2 s: long enough that a loaded machine cannot lapse it before the first check
    a, b = record("node-a", ttl_s=2.0), record("node-b", ttl_s=30.0)
    await registry.publish(a)
    await registry.publish(b)
    assert await registry.list_live() == [a, b]
    assert 0 < await redis_client.pttl(f"{redis_prefix}node:node-a") <= 2000
    deadline = time.monotonic() + 10
    while await redis_client.exists(f"{redis_prefix}node:node-a"):  # Redis's own expiry
        assert time.monotonic() < deadline, "node-a's record never expired"
        await asyncio.sleep(0.05)
    assert await registry.list_live() == [b]
    # The dead node's id was pruned from the index as well.
    assert await redis_client.smembers(f"{redis_prefix}nodes") == {b"node-b"}
    await registry.remove("node-b")
    assert await registry.list_live() == []
    assert await redis_client.exists(f"{redis_prefix}node:node-b") == 0


async def test_redis_registry_ignores_a_record_past_its_own_ttl(redis_client, redis_prefix) -> None:
    # A record whose key still exists but whose published_at + ttl has passed (e.g. a
    # republished stale snapshot) is not used.
    registry = RedisCapacityRegistry(redis_client, prefix=redis_prefix)
    await registry.publish(record("node-a", ttl_s=30.0, published_at=time.time() - 31.0))
    assert await registry.list_live() == []


class CountingRegistry(LocalCapacityRegistry):
    def __init__(self, clock) -> None:
        super().__init__(clock=clock)
        self.num_reads = 0

    async def list_live(self) -> list[CapacityRecord]:
        self.num_reads += 1
        await asyncio.sleep(0)
        return await super().list_live()


async def test_view_caches_for_at_most_max_age_and_filters_by_model() -> None:
    now = [1000.0]
    registry = CountingRegistry(clock=lambda: now[0])
    view = CapacityView(registry, max_age_s=1.0, clock=lambda: now[0])
    await registry.publish(record("node-1", published_at=1000.0, ttl_s=10.0))
    await registry.publish(record("node-2", published_at=1000.0, ttl_s=10.0, models=("other",)))

    results = await asyncio.gather(*(view.live("smollm2") for _ in range(5)))
    assert [[r.node_id for r in rs] for rs in results] == [["node-1"]] * 5
    assert registry.num_reads == 1  # concurrent readers shared one refresh

    await registry.publish(record("node-3", published_at=1000.0, ttl_s=10.0))
    now[0] = 1000.9
    assert [r.node_id for r in await view.live()] == ["node-1", "node-2"]
    now[0] = 1001.0
    assert [r.node_id for r in await view.live()] == ["node-1", "node-2", "node-3"]
    assert registry.num_reads == 2


async def test_view_never_returns_a_cached_record_past_its_ttl() -> None:
    now = [1000.0]
    registry = LocalCapacityRegistry(clock=lambda: now[0])
    view = CapacityView(registry, max_age_s=60.0, clock=lambda: now[0])
    await registry.publish(record("node-1", published_at=1000.0, ttl_s=2.0))
    assert len(await view.live()) == 1
    now[0] = 1002.0
    assert await view.live() == []


def test_record_is_frozen() -> None:
    r = record("node-1")
    with pytest.raises(AttributeError):
        r.models = ()  # type: ignore[misc]
    assert replace(r, models=("x",)).models == ("x",)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def redis_server():
    from tests.redis_server import RedisServer

    server = RedisServer()
    server.start()
    yield server
    server.stop()


async def test_while_redis_is_away_last_known_records_stand_in_for_the_grace(redis_server) -> None:
    import redis.asyncio as aioredis

    from scheduler.store_watch import StoreAway, StoreWatch

    monotonic = _Clock()  # the outage's time; the records' TTLs run on the wall clock
    watch = StoreWatch(timeout_s=0.5, retry_s=1.0, monotonic=monotonic)
    client = aioredis.Redis.from_url(redis_server.url)
    registry = RedisCapacityRegistry(client, "t:")
    view = CapacityView(registry, max_age_s=0.0, watch=watch, outage_grace_s=30.0)
    await registry.publish(record("node-1", ttl_s=1.0))
    assert [r.node_id for r in await view.live()] == ["node-1"]

    redis_server.stop()
    await asyncio.sleep(1.2)  # node-1's own TTL has passed
    assert [r.node_id for r in await view.live("smollm2")] == ["node-1"]
    assert await view.live("other") == []
    assert watch.is_away
    monotonic.now += 30.0  # the whole grace: still trusted at its end
    assert [r.node_id for r in await view.live()] == ["node-1"]
    monotonic.now += 0.5
    with pytest.raises(StoreAway):
        await view.live()

    # A fresh view that never read the registry has nothing to stand in: StoreAway.
    with pytest.raises(StoreAway):
        await CapacityView(registry, max_age_s=0.0, watch=watch).live()
    await client.aclose()


async def test_when_redis_returns_a_record_not_published_again_stays_one_ttl(
    redis_server,
) -> None:
    import redis.asyncio as aioredis

    from scheduler.store_watch import StoreWatch

    monotonic = _Clock()
    watch = StoreWatch(timeout_s=0.5, retry_s=1.0, monotonic=monotonic)
    client = aioredis.Redis.from_url(redis_server.url)
    registry = RedisCapacityRegistry(client, "t:")
    view = CapacityView(registry, max_age_s=0.0, watch=watch, outage_grace_s=30.0)
    await registry.publish(record("node-1", ttl_s=2.0))
    await registry.publish(record("node-2", ttl_s=2.0))
    assert [r.node_id for r in await view.live()] == ["node-1", "node-2"]

    redis_server.stop()
    assert [r.node_id for r in await view.live()] == ["node-1", "node-2"]
    redis_server.start()  # back empty, as after the records' expiry: nodes publish again
    await asyncio.sleep(2.1)  # the last-known records' own TTLs have passed
    monotonic.now += 5.0  # a probe is due; Redis came back just now on this clock
    await registry.publish(record("node-2", ttl_s=2.0))
    assert [r.node_id for r in await view.live()] == ["node-1", "node-2"]  # node-1 settling
    assert not watch.is_away
    monotonic.now += 2.1  # one record TTL since the return: node-1 never came back
    assert [r.node_id for r in await view.live()] == ["node-2"]
    await client.aclose()
