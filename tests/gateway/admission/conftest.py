"""Shared fixtures: a real Redis with a key prefix per test, a clock the test moves."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as redis

from gateway.admission import (
    AdmissionSettings,
    LimitPolicy,
    LimitStore,
    LocalLimiter,
    MemoryLimitStore,
    RedisLimiter,
    RedisLimitStore,
)


def redis_url() -> str:
    return os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")


class FakeClock:
    """Seconds since the epoch, moved only by the test."""

    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
async def redis_client() -> AsyncIterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url(), socket_timeout=5)
    yield client
    await client.aclose()


@pytest.fixture
async def prefix(redis_client: redis.Redis) -> AsyncIterator[str]:
    prefix = f"test-admission-{uuid.uuid4().hex[:12]}"
    yield prefix
    keys = [key async for key in redis_client.scan_iter(match=f"{prefix}:*")]
    if keys:
        await redis_client.delete(*keys)


class LimiterFactory:
    """Builds a LocalLimiter or a RedisLimiter on the same policy, store kind and clock."""

    def __init__(self, kind: str, client: redis.Redis, prefix: str) -> None:
        self.kind = kind
        self.client = client
        self.prefix = prefix
        self.store: LimitStore = (
            MemoryLimitStore() if kind == "local" else RedisLimitStore(client, prefix)
        )

    def __call__(self, policy: LimitPolicy, clock: FakeClock) -> LocalLimiter | RedisLimiter:
        if self.kind == "local":
            return LocalLimiter(policy, self.store, clock=clock)
        settings = AdmissionSettings(
            policy=policy, key_prefix=self.prefix, limits_cache_s=0, redis_timeout_s=10.0
        )
        return RedisLimiter(self.client, settings, self.store, clock=clock)


@pytest.fixture(params=["local", "redis"])
async def make_limiter(
    request: pytest.FixtureRequest, redis_client: redis.Redis, prefix: str
) -> LimiterFactory:
    return LimiterFactory(request.param, redis_client, prefix)
