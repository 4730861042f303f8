"""The capacity queue: exact round-robin order, deadlines, bounds, busy rejection."""

from __future__ import annotations

import asyncio

import pytest

from gateway.admission.queue import CapacityQueue, Placed, Rejected


class Fleet:
    """Free slots the test hands out; try_place takes one when there is one."""

    def __init__(self, free: int = 0) -> None:
        self.free = free
        self.order: list[str] = []
        self.num_tries = 0

    def try_place(self, name: str):  # type: ignore[no-untyped-def]
        async def attempt() -> str | None:
            self.num_tries += 1
            if self.free == 0:
                return None
            self.free -= 1
            self.order.append(name)
            return f"node-for-{name}"

        return attempt


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def enqueue(
    queue: CapacityQueue[str], fleet: Fleet, names: list[str], deadline_s: float = 10.0
) -> list[asyncio.Task[Placed[str] | Rejected]]:
    tasks = []
    for name in names:
        account = name.rstrip("0123456789")
        tasks.append(
            asyncio.create_task(queue.place(account, fleet.try_place(name), deadline_s=deadline_s))
        )
        await settle()
    return tasks


async def test_free_capacity_places_at_once() -> None:
    fleet, queue = Fleet(free=1), CapacityQueue[str]()
    result = await queue.place("A", fleet.try_place("A1"), deadline_s=1)
    assert isinstance(result, Placed) and result.placement == "node-for-A1"
    assert queue.num_waiting == 0


async def test_round_robin_across_accounts_fifo_within_one() -> None:
    fleet, queue = Fleet(), CapacityQueue[str](poll_s=60)
    tasks = await enqueue(queue, fleet, ["A1", "A2", "A3", "B1", "C1", "B2"])
    assert queue.num_waiting == 6
    fleet.free = 6
    queue.notify()
    results = await asyncio.gather(*tasks)
    assert fleet.order == ["A1", "B1", "C1", "A2", "B2", "A3"]
    assert [r.placement for r in results] == [
        f"node-for-{n}" for n in ["A1", "A2", "A3", "B1", "C1", "B2"]
    ]  # type: ignore[union-attr]


async def test_one_slot_at_a_time_keeps_the_rotation() -> None:
    fleet, queue = Fleet(), CapacityQueue[str](poll_s=60)
    tasks = await enqueue(queue, fleet, ["A1", "A2", "A3", "B1", "C1", "B2"])
    for _ in range(6):
        fleet.free = 1
        queue.notify()
        await settle()
    await asyncio.gather(*tasks)
    assert fleet.order == ["A1", "B1", "C1", "A2", "B2", "A3"]


async def test_a_burst_does_not_delay_another_accounts_first_request() -> None:
    fleet, queue = Fleet(), CapacityQueue[str](poll_s=60)
    burst = await enqueue(queue, fleet, [f"A{i}" for i in range(50)])
    (late,) = await enqueue(queue, fleet, ["B1"])
    fleet.free = 2
    queue.notify()
    result = await late
    assert isinstance(result, Placed)
    assert fleet.order == ["A0", "B1"]
    fleet.free = 49
    queue.notify()
    await asyncio.gather(*burst)
    assert fleet.order[2:] == [f"A{i}" for i in range(1, 50)]


async def test_reject_if_busy_never_waits() -> None:
    fleet, queue = Fleet(), CapacityQueue[str]()
    result = await queue.place("A", fleet.try_place("A1"), deadline_s=10, reject_if_busy=True)
    assert isinstance(result, Rejected) and result.reason == "busy"
    assert (fleet.num_tries, queue.num_waiting) == (1, 0)


async def test_deadline_rejects_and_leaves_the_queue() -> None:
    fleet, queue = Fleet(), CapacityQueue[str](poll_s=0.01)
    result = await queue.place("A", fleet.try_place("A1"), deadline_s=0.05)
    assert isinstance(result, Rejected) and result.reason == "deadline"
    assert result.waited_s >= 0.05
    assert queue.num_waiting == 0
    assert fleet.num_tries >= 2  # the first try, then polls while it waited


async def test_poll_finds_capacity_freed_without_a_signal() -> None:
    fleet, queue = Fleet(), CapacityQueue[str](poll_s=0.01)
    (task,) = await enqueue(queue, fleet, ["A1"])
    fleet.free = 1  # freed elsewhere; nobody calls notify()
    result = await asyncio.wait_for(task, timeout=2)
    assert isinstance(result, Placed) and result.placement == "node-for-A1"


async def test_queue_is_bounded_in_total_and_per_account() -> None:
    fleet = Fleet()
    queue = CapacityQueue[str](max_waiting=3, max_waiting_per_account=2, poll_s=60)
    tasks = await enqueue(queue, fleet, ["A1", "A2", "B1"])
    assert queue.num_waiting == 3
    full = await queue.place("C", fleet.try_place("C1"), deadline_s=10)
    assert isinstance(full, Rejected) and full.reason == "queue_full"
    queue2 = CapacityQueue[str](max_waiting=10, max_waiting_per_account=2, poll_s=60)
    tasks += await enqueue(queue2, fleet, ["A1", "A2"])
    per_account = await queue2.place("A", fleet.try_place("A3"), deadline_s=10)
    assert isinstance(per_account, Rejected) and per_account.reason == "queue_full"
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert (queue.num_waiting, queue2.num_waiting) == (0, 0)


async def test_a_cancelled_waiter_leaves_and_the_next_is_served() -> None:
    fleet, queue = Fleet(), CapacityQueue[str](poll_s=60)
    first, second = await enqueue(queue, fleet, ["A1", "B1"])
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert queue.num_waiting == 1
    fleet.free = 1
    queue.notify()
    result = await second
    assert isinstance(result, Placed) and fleet.order == ["B1"]


async def test_a_placement_in_flight_survives_the_deadline_and_abandonment() -> None:
    queue = CapacityQueue[str](poll_s=60)
    gate = asyncio.Event()
    given_back: list[str] = []
    is_first_try = True

    async def slow_place() -> str | None:
        nonlocal is_first_try
        if is_first_try:  # the first try, before queueing, finds no room
            is_first_try = False
            return None
        await gate.wait()
        return "node-1"

    async def give_back(placement: str) -> None:
        given_back.append(placement)

    # The deadline passes while a placement is being made: the placement wins.
    task = asyncio.create_task(queue.place("A", slow_place, deadline_s=0.02))
    await asyncio.sleep(0.05)
    gate.set()
    result = await task
    assert isinstance(result, Placed) and result.placement == "node-1"

    # The caller goes away while its placement is being made: the placement is given back.
    gate.clear()
    is_first_try = True
    task = asyncio.create_task(queue.place("A", slow_place, deadline_s=10, on_abandoned=give_back))
    await settle()
    task.cancel()
    await settle()
    gate.set()
    await settle()
    assert given_back == ["node-1"]
    assert queue.num_waiting == 0


async def test_try_place_errors_reach_their_own_caller() -> None:
    fleet, queue = Fleet(), CapacityQueue[str](poll_s=60)
    calls = 0

    async def broken() -> str | None:
        nonlocal calls
        calls += 1
        if calls == 1:
            return None
        raise RuntimeError("placement store down")

    task = asyncio.create_task(queue.place("A", broken, deadline_s=10))
    (other,) = await enqueue(queue, fleet, ["B1"])
    fleet.free = 1
    queue.notify()
    with pytest.raises(RuntimeError, match="placement store down"):
        await task
    assert isinstance(await other, Placed)
