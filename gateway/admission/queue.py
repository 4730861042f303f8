"""A fair, bounded wait for fleet capacity.

When no node has room, a request waits here until a placement succeeds or its
deadline passes. Accounts take turns (round-robin over the accounts that wait, FIFO
within one account), so one account's burst never delays another account's first
request by more than one placement per waiting account.

The gateway supplies, per request, an async `try_place()` returning a placement or
None (no room), and calls `notify()` whenever capacity may have freed (a request
ended, a node heartbeat). A slow poll covers capacity freed where this gateway
cannot see it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
RejectReason = Literal["busy", "queue_full", "deadline"]


@dataclass(frozen=True, slots=True)
class Placed(Generic[T]):
    placement: T
    waited_s: float


@dataclass(frozen=True, slots=True)
class Rejected:
    """No placement: busy (reject_if_busy), queue_full, or deadline (waited too long)."""

    reason: RejectReason
    waited_s: float


@dataclass(eq=False)
class _Waiter:
    account_id: str
    try_place: Callable[[], Awaitable[Any]]
    deadline: float  # monotonic seconds
    on_abandoned: Callable[[Any], Awaitable[None]] | None
    done: asyncio.Future[Any] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    is_placing: bool = False  # a try_place for it is in flight; only the drain may remove it
    is_abandoned: bool = False  # its caller went away while it was being placed


class CapacityQueue(Generic[T]):
    """Requests waiting for a node, served round-robin across accounts."""

    def __init__(
        self,
        max_waiting: int = 1024,
        max_waiting_per_account: int = 256,
        poll_s: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_waiting < 1 or max_waiting_per_account < 1:
            raise ValueError("max_waiting and max_waiting_per_account must be >= 1")
        if poll_s <= 0:
            raise ValueError(f"poll_s must be positive, got {poll_s!r}")
        self._max_waiting = max_waiting
        self._max_per_account = max_waiting_per_account
        self._poll_s = poll_s
        self._clock = clock
        # Rotation order: the first account is the next to be served.
        self._waiting: OrderedDict[str, deque[_Waiter]] = OrderedDict()
        self._num_waiting = 0
        self._num_wakeups = 0
        self._drain_task: asyncio.Task[None] | None = None
        self._poll_task: asyncio.Task[None] | None = None
        self._giving_back: set[asyncio.Future[None]] = set()

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    def num_waiting_for(self, account_id: str) -> int:
        return len(self._waiting.get(account_id, ()))

    async def place(
        self, account_id: str, try_place: Callable[[], Awaitable[T | None]], **waiting: Any
    ) -> Placed[T] | Rejected:
        """Places the request now when nobody waits, else waits its turn: `wait`, whose
        keyword options `waiting` holds."""
        if self._num_waiting == 0:
            start = self._clock()
            placement = await try_place()
            if placement is not None:
                return Placed(placement, self._clock() - start)
        return await self.wait(account_id, try_place, **waiting)

    async def wait(
        self,
        account_id: str,
        try_place: Callable[[], Awaitable[T | None]],
        *,
        deadline_s: float,
        reject_if_busy: bool = False,
        on_abandoned: Callable[[T], Awaitable[None]] | None = None,
    ) -> Placed[T] | Rejected:
        """Waits its turn for `try_place` up to `deadline_s` seconds, without a try first (for
        a caller that has just made one in vain).

        `reject_if_busy` (Workers AI's options.rejectIfBusy) never waits. When the
        caller is cancelled while its placement is being made, `on_abandoned`
        receives that placement so the gateway can give it back.
        """
        start = self._clock()
        if reject_if_busy:
            return Rejected("busy", self._clock() - start)
        if (
            self._num_waiting >= self._max_waiting
            or self.num_waiting_for(account_id) >= self._max_per_account
        ):
            return Rejected("queue_full", self._clock() - start)

        waiter = _Waiter(account_id, try_place, start + deadline_s, on_abandoned)  # type: ignore[arg-type]
        self._waiting.setdefault(account_id, deque()).append(waiter)
        self._num_waiting += 1
        self._ensure_polling()
        self.notify()  # others' placements may be possible now, and wake-ups may have been missed
        try:
            await asyncio.wait({waiter.done}, timeout=max(0.0, waiter.deadline - self._clock()))
            if not waiter.done.done():
                if not waiter.is_placing:
                    self._remove(waiter)
                    return Rejected("deadline", self._clock() - start)
                # A placement for it is in flight: its result must not be lost.
                await waiter.done
        except asyncio.CancelledError:
            if waiter.is_placing:
                waiter.is_abandoned = True
            elif not waiter.done.done():
                self._remove(waiter)
            elif (
                waiter.on_abandoned is not None
                and waiter.done.exception() is None
                and (placement := waiter.done.result()) is not None
            ):
                # Placed just as the caller left (its client went away): give it back.
                self._giving_back.add(task := asyncio.ensure_future(waiter.on_abandoned(placement)))
                task.add_done_callback(self._giving_back.discard)
            raise
        placement = waiter.done.result()
        if placement is None:
            return Rejected("deadline", self._clock() - start)
        return Placed(placement, self._clock() - start)

    def notify(self) -> None:
        """Capacity may have freed: the waiting get another round of tries."""
        self._num_wakeups += 1
        if self._num_waiting and (self._drain_task is None or self._drain_task.done()):
            self._drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def aclose(self) -> None:
        for task in (self._drain_task, self._poll_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _drain(self) -> None:
        while self._num_waiting:
            wakeups = self._num_wakeups
            is_progress = False
            # One pass: each account's oldest request gets one try, in rotation order.
            for account_id in list(self._waiting):
                queue = self._waiting.get(account_id)
                if not queue:
                    continue
                waiter = queue[0]
                waiter.is_placing = True
                try:
                    placement = await waiter.try_place()
                except Exception as exc:
                    waiter.is_placing = False
                    self._remove(waiter)
                    await self._settle(waiter, error=exc)
                    continue
                waiter.is_placing = False
                if placement is not None:
                    self._remove(waiter)
                    await self._settle(waiter, placement=placement)
                    is_progress = True
                elif self._clock() >= waiter.deadline:
                    self._remove(waiter)
                    await self._settle(waiter)
            if not is_progress and wakeups == self._num_wakeups:
                return  # nothing placed and nothing freed since: wait for the next signal

    async def _settle(
        self, waiter: _Waiter, placement: Any = None, error: Exception | None = None
    ) -> None:
        """Hands the outcome to the waiter, or gives the placement back if it left."""
        if waiter.is_abandoned or waiter.done.done():
            if placement is not None and waiter.on_abandoned is not None:
                await waiter.on_abandoned(placement)
            elif error is not None:
                log.warning("placement for an abandoned request failed: %s", error)
            return
        if error is not None:
            waiter.done.set_exception(error)
        else:
            waiter.done.set_result(placement)

    def _remove(self, waiter: _Waiter) -> None:
        queue = self._waiting.get(waiter.account_id)
        if queue is None or waiter not in queue:
            return
        is_head = queue[0] is waiter
        queue.remove(waiter)
        self._num_waiting -= 1
        if not queue:
            del self._waiting[waiter.account_id]
        elif is_head:
            # Served (or gone): the account goes to the back of the rotation.
            self._waiting.move_to_end(waiter.account_id)

    def _ensure_polling(self) -> None:
        if self._poll_task is None or self._poll_task.done():
            self._poll_task = asyncio.get_running_loop().create_task(self._poll())

    async def _poll(self) -> None:
        while self._num_waiting:
            await asyncio.sleep(self._poll_s)
            self.notify()
