"""Node reservations: the pick, renewals while a request runs, the lapse of abandoned ones,
and the table kept while Redis is away and written back when it returns."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from scheduler.reservations import Candidate, RedisReservations, pick_best
from scheduler.store_watch import StoreWatch
from tests.conftest import REDIS_URL
from tests.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_pick_best_scores_free_less_reserved_less_queue_and_honours_limits() -> None:
    a = Candidate("node-a", num_free_tokens=1000, limit_tokens=1000, queue_cost_tokens=0)
    b = Candidate("node-b", num_free_tokens=900, limit_tokens=1000, queue_cost_tokens=0)
    c = Candidate("node-c", num_free_tokens=2000, limit_tokens=500, queue_cost_tokens=256)
    assert pick_best([a, b, c], 100, {}) == 2  # 2000 - 256 beats 1000
    assert pick_best([a, b, c], 100, {"node-c": 450}) == 0  # c's limit: 450 + 100 > 500
    assert pick_best([a, b], 100, {"node-a": 200}) == 1  # 800 against 900
    assert pick_best([a, b], 100, {"node-a": 100}) == 0  # 900 against 900: the first
    assert pick_best([a, b], 100, {"node-a": 950, "node-b": 901}) is None


def slots(raw: dict[bytes, bytes]) -> dict[str, int]:
    """A reservation hash as request id -> tokens (the expiry left out)."""
    return {k.decode(): int(v.split(b":")[0]) for k, v in raw.items()}


async def test_a_held_reservation_is_renewed_and_an_abandoned_one_lapses_within_ttl(
    redis_client, redis_prefix
) -> None:
    node = [Candidate("node-a", 1000, 1000, 0)]
    holder = RedisReservations(redis_client, redis_prefix, ttl_s=1.0)
    abandoned = RedisReservations(redis_client, redis_prefix, ttl_s=1.0)  # never renews
    await holder.start()
    try:
        assert await holder.reserve_best("held", 300, node) == 0
        assert await abandoned.reserve_best("left", 200, node) == 0
        assert await holder.reserved_tokens("node-a") == 500
        await asyncio.sleep(2.0)  # twice the TTL: "held" renewed six times, "left" lapsed
        assert await holder.reserved_tokens("node-a") == 300
        assert await holder.reserve_best("next", 700, node) == 0  # "left" makes room again
        await holder.release("node-a", "held")
        await holder.release("node-a", "next")
        # A release that meets a renewal on its way is written back by it, and deleted by
        # the next renewal (a third of the TTL later): never held past that.
        deadline = time.monotonic() + 0.34 + 0.5
        while (tokens := await holder.reserved_tokens("node-a")) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert tokens == 0
        # "next"'s reservation dropped the lapsed "left" from the hash as it met it
        assert await redis_client.hgetall(f"{redis_prefix}resv:node-a") == {}
    finally:
        await holder.aclose()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    yield server
    server.stop()


async def test_while_redis_is_away_reservations_are_local_and_written_back_on_return(
    redis_server: RedisServer,
) -> None:
    clock = Clock()
    watch = StoreWatch(timeout_s=0.5, retry_s=60.0, monotonic=clock)
    client = aioredis.Redis.from_url(redis_server.url)
    table = RedisReservations(client, "t:", ttl_s=6.0, watch=watch)
    a = Candidate("node-a", num_free_tokens=1000, limit_tokens=1000, queue_cost_tokens=0)
    b = Candidate("node-b", num_free_tokens=550, limit_tokens=1000, queue_cost_tokens=0)
    assert await table.reserve_best("before", 400, [a, b]) == 0
    assert await table.reserve_best("kept", 100, [a, b]) == 0  # a 1000 - 400 against b 550

    redis_server.freeze()  # a hanging Redis: what was written stays
    assert await table.reserved_tokens("node-a") == 500  # times out: this gateway's own
    assert watch.is_away
    # Picked against what this gateway holds, with the Lua script's scores.
    assert await table.reserve_best("during", 300, [a, b]) == 1  # a 1000 - 500, b 550
    assert await table.reserve_best("during-2", 500, [a, b]) == 0  # a 500, b 550 - 300
    assert table.held_tokens() == {"node-a": 1000, "node-b": 300}
    assert await table.reserve_best("too-big", 701, [a, b]) is None  # past both limits
    await table.release("node-a", "before")  # Redis holds it: pending
    await table.release("node-a", "during-2")  # never written to Redis: nothing to send
    assert (table.held_tokens(), table.num_pending) == ({"node-a": 100, "node-b": 300}, 1)
    redis_server.thaw()

    await table.renew()  # the background probe: Redis is back
    assert not watch.is_away and table.num_pending == 0
    assert slots(await client.hgetall("t:resv:node-a")) == {"kept": 100}
    assert slots(await client.hgetall("t:resv:node-b")) == {"during": 300}
    assert await table.reserved_tokens("node-b") == 300
    await table.release("node-b", "during")  # written there by the renewal: released there
    await table.release("node-a", "kept")
    assert await client.hgetall("t:resv:node-a") == {}
    assert await client.hgetall("t:resv:node-b") == {}
    await client.aclose()


HOLDER = """
import asyncio, sys
import redis.asyncio as aioredis
from scheduler.reservations import Candidate, RedisReservations

async def main() -> None:
    table = RedisReservations(aioredis.Redis.from_url(sys.argv[1]), sys.argv[2], ttl_s=1.5)
    await table.start()
    assert await table.reserve_best("held", 100, [Candidate("node-a", 1000, 1000, 0)]) == 0
    print("ready", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_a_sigkilled_gateways_reservation_lapses_within_its_ttl(
    redis_client, redis_prefix
) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, REDIS_URL, redis_prefix],
        cwd=ROOT, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == b"ready\n"
        table = RedisReservations(redis_client, redis_prefix)
        await asyncio.sleep(3.0)  # twice its TTL: alive, it renews
        assert await table.reserved_tokens("node-a") == 100
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        killed = time.monotonic()
        while await table.reserved_tokens("node-a") == 100:
            await asyncio.sleep(0.05)
        # The last renewal came at most ttl / 3 before the kill.
        assert time.monotonic() - killed <= 1.5 + 0.5
    finally:
        holder.kill()
        holder.wait()
