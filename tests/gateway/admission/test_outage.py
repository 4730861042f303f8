"""Redis trouble: a redis-server this test starts on a free port, then freezes or kills."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import pytest
import redis.asyncio as redis

from gateway.admission import (
    AdmissionSettings,
    AdmissionUnavailable,
    LimitPolicy,
    Limits,
    RedisLimiter,
    RedisLimitStore,
)
from tests.redis_server import RedisServer

from .conftest import FakeClock

# No skip: scripts/services.sh needs redis-server too, so its absence is an install bug.

# Bounds on a call that meets the timeout add 1.5 s for a loaded machine (a hang would never
# end); a degraded gateway's answer, which makes no Redis call, is bounded by TIMEOUT_S alone.
TIMEOUT_S = 0.5
RETRY_S = 0.3


@pytest.fixture
def server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    yield server
    server.stop()


def limiter(
    client: redis.Redis,
    mode: str,
    limits: Limits,
    monotonic: Callable[[], float] = time.monotonic,
) -> RedisLimiter:
    settings = AdmissionSettings(
        policy=LimitPolicy(default=limits),
        on_redis_error=mode,  # type: ignore[arg-type]
        redis_timeout_s=TIMEOUT_S,
        redis_retry_s=RETRY_S,
    )
    return RedisLimiter(client, settings, monotonic=monotonic)


async def timed(call: object) -> tuple[object, float]:
    start = time.monotonic()
    try:
        result = await call  # type: ignore[misc]
    except AdmissionUnavailable as exc:
        result = exc
    return result, time.monotonic() - start


async def test_fail_closed_answers_unavailable_within_the_timeout_and_recovers(
    server: RedisServer,
) -> None:
    client = redis.Redis.from_url(server.url)
    # The degraded window's time is a fake clock moved by the test, so a slow machine
    # cannot end it between the first failure and the next request.
    monotonic = FakeClock(100.0)
    gate = limiter(client, "closed", Limits(requests_per_minute=100), monotonic)
    assert (await gate.acquire("acct", "m", "before", 1)).admitted

    server.freeze()  # connections stay open but nothing answers: the hanging kind of outage
    result, elapsed = await timed(gate.acquire("acct", "m", "during-1", 1))
    assert isinstance(result, AdmissionUnavailable)
    assert elapsed < TIMEOUT_S + 1.5
    # While degraded, requests do not wait on Redis at all.
    result, elapsed = await timed(gate.acquire("acct", "m", "during-2", 1))
    assert isinstance(result, AdmissionUnavailable)
    assert elapsed < TIMEOUT_S
    _, elapsed = await timed(gate.release("acct", "m", "before", 1))  # never raises
    assert elapsed < TIMEOUT_S + 1.5

    server.thaw()  # the frozen server now runs the acquire whose reply was lost
    deadline = time.monotonic() + 10
    while b"during-1" not in await client.zrange("edgeserve:rl:{acct|m}:log", 0, -1):
        assert time.monotonic() < deadline, "the lost acquire never ran"
        await asyncio.sleep(0.02)
    monotonic.advance(RETRY_S)  # the degraded window ends: the next acquire asks Redis again
    after = await gate.acquire("acct", "m", "after", 1)
    assert after.admitted and not gate.is_degraded
    await gate.heartbeat()  # takes back what the lost acquire reserved
    logged = await client.zrange("edgeserve:rl:{acct|m}:log", 0, -1)
    assert sorted(logged) == [b"after", b"before"]
    await client.aclose()


async def test_fail_open_uses_local_shares_then_shared_limits_again(server: RedisServer) -> None:
    limits = Limits(requests_per_minute=10, tokens_per_minute=10_000, max_concurrent=100)
    clients = [redis.Redis.from_url(server.url) for _ in range(2)]
    store = RedisLimitStore(clients[0])
    await store.save("acct", limits)  # the account's override; the default is 300/min
    a, b = (limiter(c, "open", Limits()) for c in clients)
    assert [await a.heartbeat(), await b.heartbeat()] == [1, 2]
    assert await a.heartbeat() == 2
    # Each gateway has seen the account's override before Redis goes away.
    assert (await a.acquire("other", "m", "seen-a0", 1)).admitted
    assert (await a.acquire("acct", "m2", "seen-a", 1)).admitted
    assert (await b.acquire("acct", "m2", "seen-b", 1)).admitted

    server.stop()  # Redis is gone: connections refused
    answers_a = [await a.acquire("acct", "m", f"a{i}", 1) for i in range(8)]
    answers_b = [await b.acquire("acct", "m", f"b{i}", 1) for i in range(8)]
    # Each of the two live gateways enforces half of the limit on its own.
    assert [x.admitted for x in answers_a] == [True] * 5 + [False] * 3
    assert [x.admitted for x in answers_b] == [True] * 5 + [False] * 3
    assert answers_a[5].reason == "requests"
    assert answers_a[5].headers["x-ratelimit-limit-requests"] == "5"
    await a.release("acct", "m", "a0", 1)  # released where it was admitted: locally

    server.start()  # back, empty (no persistence): the operator sets the override again
    await store.save("acct", limits)
    await asyncio.sleep(max(RETRY_S, 1.0))  # past the 1 s override cache
    burst = await asyncio.gather(
        *(g.acquire("acct", "m", f"s{i}", 1) for i in range(16) for g in [(a, b)[i % 2]])
    )
    assert sum(x.admitted for x in burst) == 10  # one shared limit again
    assert burst[0].headers["x-ratelimit-limit-requests"] == "10"
    assert not a.is_degraded and not b.is_degraded
    for c in clients:
        await c.aclose()


async def test_heartbeat_failure_marks_degraded_and_a_later_one_recovers(
    server: RedisServer,
) -> None:
    client = redis.Redis.from_url(server.url)
    # the degraded window on a fake clock: a slow machine cannot end it before the check
    gate = limiter(client, "open", Limits(), FakeClock(100.0))
    assert await gate.heartbeat() == 1
    server.freeze()
    start = time.monotonic()
    assert await gate.heartbeat() == 1  # last count kept
    assert time.monotonic() - start < TIMEOUT_S + 1.5
    assert gate.is_degraded
    server.thaw()
    assert await gate.heartbeat() == 1
    assert not gate.is_degraded
    await client.aclose()
