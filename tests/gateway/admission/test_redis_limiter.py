"""Several gateways, one limit: separate processes and limiters over one real Redis."""

from __future__ import annotations

import asyncio
import multiprocessing

import redis.asyncio as redis

from gateway.admission import AdmissionSettings, LimitPolicy, Limits, RedisLimiter

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
