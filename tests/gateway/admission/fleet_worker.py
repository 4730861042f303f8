"""One gateway process of the fleet tests: its own Redis connection, a burst of acquires."""

from __future__ import annotations

import asyncio
from multiprocessing.synchronize import Barrier

import redis.asyncio as redis

from gateway.admission import AdmissionSettings, LimitPolicy, Limits, RedisLimiter


async def _fire(
    url: str, prefix: str, limits: Limits, worker: int, num_requests: int, barrier: Barrier
) -> list[str]:
    client = redis.Redis.from_url(url, socket_timeout=5)
    # Exactness is under test here, not outages: a generous timeout keeps a loaded test
    # machine from sending requests to the fail-open fallback.
    settings = AdmissionSettings(
        policy=LimitPolicy(default=limits), key_prefix=prefix, redis_timeout_s=10.0
    )
    limiter = RedisLimiter(client, settings)
    await client.ping()  # connected before the start line, so the burst really overlaps
    # A sibling that never reaches the start line breaks the barrier instead of hanging us.
    await asyncio.to_thread(barrier.wait, 60)
    request_ids = [f"w{worker}-r{i}" for i in range(num_requests)]
    answers = await asyncio.gather(*(limiter.acquire("acct", "m", r, 1) for r in request_ids))
    assert not limiter.is_degraded
    await client.aclose()
    return [r for r, answer in zip(request_ids, answers, strict=True) if answer.admitted]


def fire(
    url: str,
    prefix: str,
    limits: Limits,
    worker: int,
    num_requests: int,
    barrier: Barrier,
    results: object,
) -> None:
    admitted = asyncio.run(_fire(url, prefix, limits, worker, num_requests, barrier))
    results.put((worker, admitted))  # type: ignore[attr-defined]
