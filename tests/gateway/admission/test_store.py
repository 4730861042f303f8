"""Where per-account overrides live: a dict for one process, one Redis hash per account."""

from __future__ import annotations

import pytest
import redis.asyncio as redis

from gateway.admission import InvalidLimits, InvalidRequest, Limits, MemoryLimitStore
from gateway.admission.limits import AccountLimits
from gateway.admission.store import LimitStore, RedisLimitStore


@pytest.fixture(params=["memory", "redis"])
def store(request: pytest.FixtureRequest, redis_client: redis.Redis, prefix: str) -> LimitStore:
    if request.param == "memory":
        return MemoryLimitStore()
    return RedisLimitStore(redis_client, prefix)


async def test_overrides_are_saved_loaded_and_cleared_by_scope(store: LimitStore) -> None:
    assert await store.load("acct") == AccountLimits()
    await store.save("acct", Limits(10, 1_000, 2))
    await store.save("acct", Limits(5, 500, 1), model="smollm2")
    await store.save("acct", Limits(6, 600, 1), model="qwen")
    await store.save("acct", Limits(7, 700, 1), model="qwen")  # replaces the one before
    assert await store.load("acct") == AccountLimits(
        account=Limits(10, 1_000, 2),
        per_model={"smollm2": Limits(5, 500, 1), "qwen": Limits(7, 700, 1)},
    )
    assert await store.load("other") == AccountLimits()
    assert await store.clear("acct", model="qwen") is True
    assert await store.clear("acct", model="qwen") is False
    assert await store.clear("acct") is True
    assert await store.load("acct") == AccountLimits(per_model={"smollm2": Limits(5, 500, 1)})


async def test_ids_that_cannot_name_a_key_are_refused(store: LimitStore) -> None:
    with pytest.raises(InvalidRequest, match="account id 'a b' must be"):
        await store.load("a b")
    with pytest.raises(InvalidRequest, match=r"model 'm\*' must be"):
        await store.save("acct", Limits(), model="m*")


async def test_the_redis_hash_holds_json_per_scope(redis_client: redis.Redis, prefix: str) -> None:
    store = RedisLimitStore(redis_client, prefix)
    await store.save("acct", Limits(10, 1_000, 2))
    await store.save("acct", Limits(5, 500, 1), model="smollm2")
    assert store.key("acct") == f"{prefix}:limits:acct"
    assert await redis_client.hgetall(f"{prefix}:limits:acct") == {
        b"*": b'{"requests_per_minute": 10, "tokens_per_minute": 1000, "max_concurrent": 2}',
        b"smollm2": b'{"requests_per_minute": 5, "tokens_per_minute": 500, "max_concurrent": 1}',
    }


@pytest.mark.parametrize(
    ("stored", "message"),
    [
        (b"{oops", "stored limits are not JSON: '{oops'"),
        (b"[1, 2]", "stored limits are not an object: '[1, 2]'"),
        (b'{"rpm": 1}', "unknown limit field(s): rpm"),
        (b'{"max_concurrent": 0}', "max_concurrent must be a positive integer, got 0"),
    ],
)
async def test_a_stored_override_that_is_not_limits_is_an_error(
    redis_client: redis.Redis, prefix: str, stored: bytes, message: str
) -> None:
    store = RedisLimitStore(redis_client, prefix)
    await redis_client.hset(store.key("acct"), "*", stored)
    with pytest.raises(InvalidLimits) as raised:
        await store.load("acct")
    assert str(raised.value) == message
