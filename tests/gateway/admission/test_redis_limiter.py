"""Several gateways, one limit: separate processes and limiters over one real Redis; and
Redis trouble: a redis-server a test starts on a free port, then freezes or kills."""

from __future__ import annotations

import asyncio
import multiprocessing
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

from . import fleet_worker
from .conftest import FakeClock, redis_url

NUM_GATEWAYS = 3


def run_fleet(prefix: str, limits: Limits, requests_per_gateway: int) -> dict[int, list[str]]:
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(NUM_GATEWAYS)
    results = ctx.Queue()
    processes = [
        ctx.Process(
            target=fleet_worker.fire,
            args=(redis_url(), prefix, limits, i, requests_per_gateway, barrier, results),
        )
        for i in range(NUM_GATEWAYS)
    ]
    for p in processes:
        p.start()
    try:
        admitted = dict(results.get(timeout=60) for _ in processes)
    finally:
        # A worker that failed must not leave the others (or pytest's exit) waiting.
        for p in processes:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    assert [p.exitcode for p in processes] == [0] * NUM_GATEWAYS
    return admitted


async def test_three_gateway_processes_admit_exactly_60_per_minute(
    redis_client: redis.Redis, prefix: str
) -> None:
    limits = Limits(requests_per_minute=60, tokens_per_minute=10**6, max_concurrent=10**6)
    admitted = await asyncio.to_thread(run_fleet, prefix, limits, 50)

    assert sum(len(ids) for ids in admitted.values()) == 60
    assert sorted(admitted) == [0, 1, 2]
    # The shared log holds exactly the admitted requests, no more.
    log_key = f"{prefix}:rl:{{acct|m}}:log"
    logged = sorted(m.decode() for m in await redis_client.zrange(log_key, 0, -1))
    assert logged == sorted(r for ids in admitted.values() for r in ids)


async def test_concurrency_cap_holds_across_gateway_processes(
    redis_client: redis.Redis, prefix: str
) -> None:
    limits = Limits(requests_per_minute=10**6, tokens_per_minute=10**6, max_concurrent=7)
    admitted = await asyncio.to_thread(run_fleet, prefix, limits, 30)
    assert sum(len(ids) for ids in admitted.values()) == 7
    assert await redis_client.zcard(f"{prefix}:rl:{{acct|m}}:leases") == 7


def gateway(client: redis.Redis, prefix: str, limits: Limits, clock: FakeClock) -> RedisLimiter:
    settings = AdmissionSettings(
        policy=LimitPolicy(default=limits),
        key_prefix=prefix,
        lease_s=30,
        heartbeat_s=5,
        redis_timeout_s=10.0,
    )
    return RedisLimiter(client, settings, clock=clock)


async def test_freed_slots_are_reused_under_parallel_bursts(
    redis_client: redis.Redis, prefix: str
) -> None:
    limits = Limits(requests_per_minute=1000, tokens_per_minute=10**6, max_concurrent=4)
    clock = FakeClock()
    a, b = (
        gateway(redis_client, prefix, limits, clock),
        gateway(redis_client, prefix, limits, clock),
    )
    ids = [f"r{i}" for i in range(20)]
    first = await asyncio.gather(
        *((a if i % 2 else b).acquire("acct", "m", r, 1) for i, r in enumerate(ids))
    )
    held = [(i, r) for i, (r, ans) in enumerate(zip(ids, first, strict=True)) if ans.admitted]
    assert len(held) == 4
    # Two finish; a second burst gets exactly those two slots.
    for i, r in held[:2]:
        await (a if i % 2 else b).release("acct", "m", r, 1)
    more = [f"s{i}" for i in range(20)]
    second = await asyncio.gather(
        *((a if i % 2 else b).acquire("acct", "m", r, 1) for i, r in enumerate(more))
    )
    assert sum(ans.admitted for ans in second) == 2


async def test_a_crashed_gateways_slots_expire_and_live_ones_are_renewed(
    redis_client: redis.Redis, prefix: str
) -> None:
    limits = Limits(requests_per_minute=1000, tokens_per_minute=10**6, max_concurrent=1)
    clock = FakeClock(5_000.0)
    live, crashed, other = (gateway(redis_client, prefix, limits, clock) for _ in range(3))

    assert (await crashed.acquire("acct", "m", "lost", 1)).admitted  # never released
    assert (await other.acquire("acct", "m", "x1", 1)).reason == "concurrency"
    clock.advance(29.999)
    assert (await other.acquire("acct", "m", "x2", 1)).reason == "concurrency"
    clock.advance(0.001)  # the 30 s lease ran out
    assert (await live.acquire("acct", "m", "kept", 1)).admitted

    clock.advance(20)
    await live.heartbeat()  # still serving "kept": lease renewed to now + 30 s
    clock.advance(20)
    assert (await other.acquire("acct", "m", "x3", 1)).reason == "concurrency"
    clock.advance(10)
    assert (await other.acquire("acct", "m", "x4", 1)).admitted


async def test_gateways_count_the_live_ones(redis_client: redis.Redis, prefix: str) -> None:
    clock = FakeClock(9_000.0)
    limits = Limits()
    a, b, c = (gateway(redis_client, prefix, limits, clock) for _ in range(3))
    assert [await g.heartbeat() for g in (a, b, c)] == [1, 2, 3]
    await c.aclose()  # a clean shutdown deregisters at once
    assert await a.heartbeat() == 2
    clock.advance(15)  # b missed three heartbeats (ttl 3 x 5 s)
    assert await a.heartbeat() == 1
    assert a.num_gateways == 1


class CountingLimiter(RedisLimiter):
    """A real limiter that counts its finished heartbeats (its own background ones too)."""

    num_beats = 0

    async def heartbeat(self) -> int:
        count = await super().heartbeat()
        self.num_beats += 1
        return count

    async def beats(self, n: int) -> None:
        """Until `n` more heartbeats have finished (10 s at most)."""
        target = self.num_beats + n
        async with asyncio.timeout(10):
            while self.num_beats < target:
                await asyncio.sleep(0.005)


async def test_background_heartbeat_keeps_a_long_request_slot(
    redis_client: redis.Redis, prefix: str
) -> None:
    # The leases' time is a fake clock moved by the test, so a slow machine cannot let one
    # lapse between two background heartbeats (every 0.05 s of real time).
    clock = FakeClock(7_000.0)
    settings = AdmissionSettings(
        policy=LimitPolicy(default=Limits(max_concurrent=1)),
        key_prefix=prefix,
        lease_s=0.3,
        heartbeat_s=0.05,
        redis_timeout_s=10.0,
    )
    other = RedisLimiter(redis_client, settings, clock=clock)
    async with CountingLimiter(redis_client, settings, clock=clock) as serving:
        assert (await serving.acquire("acct", "m", "long", 1)).admitted
        for _ in range(4):  # 1 s, three leases long: only renewal keeps the slot
            clock.advance(0.25)
            await serving.beats(2)  # the second began after the advance: renewed to now + 0.3
        assert (await other.acquire("acct", "m", "x1", 1)).reason == "concurrency"
        assert await other.heartbeat() == 2
    assert await other.heartbeat() == 1  # the closed gateway deregistered
    clock.advance(0.31)  # its unreleased slot is no longer renewed
    assert (await other.acquire("acct", "m", "x2", 1)).admitted


# -- Redis trouble: a redis-server of the test's own, frozen or killed ----------------------
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
