"""StoreWatch: when an outage begins and ends, which calls it skips, and for how long."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, ResponseError

from scheduler.store_watch import StoreAway, StoreWatch
from tests.conftest import free_port


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def dead_redis():
    """A client of a port nobody listens on: every call is refused, for real."""
    client = aioredis.Redis(port=free_port(), socket_connect_timeout=1.0)
    yield client
    await client.aclose()


async def test_an_outage_skips_calls_until_retry_s_and_ends_at_the_first_success(
    dead_redis, redis_client
) -> None:
    clock = Clock()
    watch = StoreWatch(timeout_s=2.0, retry_s=1.0, monotonic=clock)
    assert (watch.is_away, watch.outage_age_s()) == (False, None)

    with pytest.raises(StoreAway) as failed:
        await watch.call(dead_redis.ping)
    assert (failed.value.was_sent, watch.is_away, watch.outage_age_s()) == (True, True, 0.0)

    calls = []

    async def ping() -> bool:
        calls.append(clock.now)
        return bool(await redis_client.ping())

    clock.now = 100.9
    with pytest.raises(StoreAway) as skipped:
        await watch.call(ping)  # within retry_s: not even tried
    assert (skipped.value.was_sent, calls) == (False, [])
    assert await watch.call(ping, force=True) is True  # a background probe always tries
    assert (calls, watch.is_away) == ([100.9], False)

    # back: outage_age_s answers for settle_s more, from the outage's start
    clock.now = 102.0
    assert watch.outage_age_s() is None
    assert watch.outage_age_s(settle_s=1.2) == pytest.approx(2.0)
    assert watch.outage_age_s(settle_s=1.0) is None


async def test_a_failure_moves_the_next_probe_and_a_due_probe_tries(
    dead_redis, redis_client
) -> None:
    clock = Clock()
    watch = StoreWatch(timeout_s=2.0, retry_s=1.0, monotonic=clock)
    with pytest.raises(StoreAway):
        await watch.call(dead_redis.ping)
    clock.now = 101.0
    with pytest.raises(StoreAway) as again:
        await watch.call(dead_redis.ping)  # due: tried, and failed again
    assert again.value.was_sent
    clock.now = 101.5
    with pytest.raises(StoreAway) as skipped:
        await watch.call(redis_client.ping)
    assert not skipped.value.was_sent
    assert watch.outage_age_s() == pytest.approx(1.5)  # from the first failure
    clock.now = 102.0
    assert await watch.call(redis_client.ping) is True
    assert not watch.is_away


async def test_errors_of_ours_are_not_an_outage(redis_client, redis_prefix) -> None:
    watch = StoreWatch(timeout_s=2.0)
    await redis_client.set(f"{redis_prefix}string", "x")
    with pytest.raises(ResponseError) as wrong:
        await watch.call(lambda: redis_client.hget(f"{redis_prefix}string", "f"))  # WRONGTYPE
    assert not isinstance(wrong.value, StoreAway)
    assert not watch.is_away


async def test_readonly_is_an_outage() -> None:
    watch = StoreWatch()

    async def readonly() -> None:
        raise ReadOnlyError("You can't write against a read only replica.")

    with pytest.raises(StoreAway):
        await watch.call(readonly)
    assert watch.is_away


async def test_a_cancel_the_client_turns_into_a_connection_error_still_cancels() -> None:
    """redis-py can answer a cancel that meets a timeout with ConnectionError: the call
    must end the cancelled task anyway (a stopped renewal loop would run on forever)."""
    watch = StoreWatch(timeout_s=5.0)
    entered = asyncio.Event()

    async def swallowing() -> None:
        entered.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            raise RedisConnectionError("Connection closed by server.") from None

    is_stopped = False

    async def loop() -> None:
        while not is_stopped:  # what a background loop does with StoreAway: go on
            with contextlib.suppress(StoreAway):
                await watch.call(swallowing)

    task = asyncio.create_task(loop())
    await entered.wait()
    task.cancel()
    await asyncio.wait({task}, timeout=2.0)
    is_stopped = True  # so that a failing run ends too
    if not task.done():
        task.cancel()
    assert task.cancelled()
    assert watch.is_away  # the failed call still counts as one


async def test_a_timeout_alone_is_an_outage_not_a_cancel() -> None:
    watch = StoreWatch(timeout_s=0.05)
    with pytest.raises(StoreAway):
        await watch.call(lambda: asyncio.sleep(1))
    assert asyncio.current_task().cancelling() == 0
