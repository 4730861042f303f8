"""Whether the fleet's shared store (Redis) is away, and since when.

One `StoreWatch` per gateway is handed to everything that reads or writes Redis on the
request path (keys, admission, the capacity view, reservations, affinities). Each call
goes through `call`: it is bounded by `timeout_s`, and a call that fails because the store
cannot serve (`is_store_unavailable`) starts an outage. While the store is away, request
calls skip it without waiting for `retry_s` after each failure, then try it again;
background tasks (heartbeats, renewals) always try. The first call that succeeds ends the outage,
and each caller falls back to its own last-known state meanwhile.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.exceptions import (
    ClusterDownError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

T = TypeVar("T")

# Redis errors that say the store cannot serve for now, not that we asked it wrongly: it is
# away, a replica after a failover (READONLY), full (OOM), loading a restart, refusing writes
# (MISCONF: a failed snapshot; NOREPLICAS: min-replicas-to-write), or busy with a script.
_UNAVAILABLE = (
    RedisConnectionError,
    RedisTimeoutError,
    ReadOnlyError,
    OutOfMemoryError,
    ClusterDownError,
    TryAgainError,
)
_UNAVAILABLE_CODES = frozenset({"MISCONF", "NOREPLICAS", "BUSY"})


def is_store_unavailable(exc: BaseException) -> bool:
    """Whether a Redis error means "retry shortly" (503) rather than a fault of ours (500)."""
    if isinstance(exc, _UNAVAILABLE):
        return True
    # redis-py keeps a code it has no class for as the message's first word
    return isinstance(exc, ResponseError) and str(exc).split(" ", 1)[0] in _UNAVAILABLE_CODES


class StoreAway(RedisConnectionError):
    """The store did not serve this call, or was skipped while away: a 503 where nothing
    last-known can stand in. `was_sent`: the call reached the wire, so Redis may have run it."""

    def __init__(self, message: str, *, was_sent: bool) -> None:
        super().__init__(message)
        self.was_sent = was_sent


class StoreWatch:
    """The one place that knows whether Redis is away, since when, and when it came back."""

    def __init__(
        self,
        timeout_s: float = 0.25,
        retry_s: float = 1.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if timeout_s <= 0 or retry_s <= 0:
            raise ValueError(f"timeout_s and retry_s must be > 0, got {timeout_s}, {retry_s}")
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self._monotonic = monotonic
        self._away_since: float | None = None
        self._next_probe = 0.0
        self._last_outage: tuple[float, float] | None = None  # (began, ended)

    @property
    def is_away(self) -> bool:
        return self._away_since is not None

    def outage_age_s(self, settle_s: float = 0.0) -> float | None:
        """Seconds since the outage began, while the store is away or came back less than
        `settle_s` ago (what was written to it meanwhile is still missing); else None."""
        now = self._monotonic()
        if self._away_since is not None:
            return now - self._away_since
        if self._last_outage is not None and now - self._last_outage[1] < settle_s:
            return now - self._last_outage[0]
        return None

    async def call(self, make: Callable[[], Awaitable[T]], *, force: bool = False) -> T:
        """`make()`'s result, bounded by `timeout_s`; StoreAway when the store cannot serve
        it, or without trying while it is away and no probe is due (unless `force`)."""
        if self._away_since is not None and not force and self._monotonic() < self._next_probe:
            raise StoreAway("the shared store is away", was_sent=False)
        task = asyncio.current_task()
        num_cancels = 0 if task is None else task.cancelling()
        try:
            async with asyncio.timeout(self.timeout_s):
                result = await make()
        except (RedisError, OSError, TimeoutError) as exc:
            if isinstance(exc, RedisError) and not is_store_unavailable(exc):
                raise  # asked wrongly: a fault of ours, not an outage
            self.failed()
            # A cancel that met our timeout inside redis-py can come out as a connection
            # error: the task's cancel count still says so, and the cancel must stand, or a
            # background loop being stopped runs on.
            if task is not None and task.cancelling() > num_cancels:
                raise asyncio.CancelledError from exc
            raise StoreAway(f"the shared store did not serve: {exc!r}", was_sent=True) from exc
        self._succeeded()
        if task is not None and task.cancelling() > num_cancels:
            raise asyncio.CancelledError  # a cancel redis-py absorbed (it retried, and got through)
        return result

    def failed(self) -> None:
        now = self._monotonic()
        if self._away_since is None:
            self._away_since = now
        self._next_probe = now + self.retry_s

    def _succeeded(self) -> None:
        if self._away_since is not None:
            self._last_outage = (self._away_since, self._monotonic())
            self._away_since = None
