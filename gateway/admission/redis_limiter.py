"""Admission shared by every gateway through Redis: one atomic script per check-and-take."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from importlib import resources
from types import TracebackType
from typing import TypeVar

import redis.asyncio as redis

from gateway.admission.errors import AdmissionUnavailable, DuplicateRequestId
from gateway.admission.limiter import check_request
from gateway.admission.limits import AccountLimits, Limits
from gateway.admission.local import UNBOUNDED_LEASE_MS, check_size, now_ms
from gateway.admission.result import (
    CONCURRENCY_RETRY_MS,
    REASONS,
    WINDOW_MS,
    Admission,
    WindowState,
    build_admission,
)
from gateway.admission.settings import AdmissionSettings
from gateway.admission.store import LimitStore, RedisLimitStore
from gateway.admission.window import LocalWindows
from scheduler.store_watch import StoreAway, StoreWatch

log = logging.getLogger(__name__)

T = TypeVar("T")
Bucket = tuple[str, str]  # (account id, model)

_DUPLICATE = 4  # acquire.lua's reason code for a request id already admitted
# Accounts whose overrides are cached (also the limits fail-open falls back to).
MAX_CACHED_ACCOUNTS = 100_000


@dataclass(frozen=True, slots=True)
class _Held:
    bucket: Bucket
    is_local: bool  # admitted by the fail-open fallback, so released there too


def _script(client: redis.Redis, name: str) -> redis.client.AsyncScript:  # type: ignore[name-defined]
    source = resources.files("gateway.admission").joinpath("lua", name).read_text()
    return client.register_script(source)


class RedisLimiter:
    """Limits enforced once for the whole fleet; see window.py for the algorithm.

    Every Redis call is bounded by `redis_timeout_s`. When one fails, the limiter
    either raises AdmissionUnavailable (fail-closed) or admits against this gateway's
    share of the limits (fail-open: the limit divided by the live gateways it last
    counted), and goes back to Redis by itself `redis_retry_s` later.

    Run `start()` (or `async with`) so the gateway registers its heartbeat and renews
    the concurrency leases of requests it still serves.
    """

    def __init__(
        self,
        client: redis.Redis,
        settings: AdmissionSettings | None = None,
        store: LimitStore | None = None,
        *,
        gateway_id: str | None = None,
        clock: Callable[[], float] | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        watch: StoreWatch | None = None,
    ) -> None:
        self._redis = client
        self._settings = settings or AdmissionSettings()
        self._store = store or RedisLimitStore(client, self._settings.key_prefix)
        self.gateway_id = gateway_id or uuid.uuid4().hex
        # None: Redis's own clock, so every gateway reads one time; tests pass a fake one.
        self._clock = clock
        self._monotonic = monotonic
        # Shared with the gateway's other Redis users, so one failure degrades them all.
        self._watch = watch or StoreWatch(
            self._settings.redis_timeout_s, self._settings.redis_retry_s, monotonic
        )
        self._acquire = _script(client, "acquire.lua")
        self._release = _script(client, "release.lua")
        self._renew = _script(client, "renew.lua")
        self._heartbeat = _script(client, "heartbeat.lua")
        self._forget = _script(client, "forget.lua")
        self._fallback = LocalWindows()
        self._held: dict[str, _Held] = {}
        # Acquires whose reply was lost: taken back at the next heartbeat that reaches Redis.
        self._unanswered: dict[str, Bucket] = {}
        self._overrides: dict[str, tuple[float, AccountLimits]] = {}
        self._num_gateways = 1
        self._task: asyncio.Task[None] | None = None

    @property
    def num_gateways(self) -> int:
        """Live gateways at the last successful heartbeat (this one included)."""
        return self._num_gateways

    @property
    def is_degraded(self) -> bool:
        """True while Redis is away: requests count against this gateway's local share."""
        return self._watch.is_away

    async def acquire(
        self, account_id: str, model: str, request_id: str, estimated_tokens: int
    ) -> Admission:
        check_request(account_id, model, request_id, estimated_tokens)
        if request_id in self._held:
            raise DuplicateRequestId(f"request id {request_id!r} is already admitted")
        bucket = (account_id, model)
        try:
            limits = self._settings.policy.resolve(await self._load(account_id), model)
            check_size(estimated_tokens, limits)
            state = await self._take_shared(bucket, limits, request_id, estimated_tokens)
        except StoreAway:
            return self._take_local(bucket, request_id, estimated_tokens)
        if state.reason is None:
            self._held[request_id] = _Held(bucket, is_local=False)
        return build_admission(limits, state)

    async def release(
        self, account_id: str, model: str, request_id: str, actual_tokens: int
    ) -> None:
        check_request(account_id, model, request_id, actual_tokens)
        held = self._held.pop(request_id, None)
        if held is None:
            return
        if held.is_local:
            self._fallback.release(held.bucket, request_id, actual_tokens)
            return
        if self.is_degraded:
            # Do not make a finishing response wait on a store known to be down: the lease
            # lapses by itself and the reservation stays as reserved (the conservative side).
            return
        try:
            await self._call(
                lambda: self._release(
                    keys=self._keys(held.bucket), args=[request_id, actual_tokens]
                )
            )
        except StoreAway:
            # The lease runs out by itself; the reservation stays as reserved (the
            # conservative side) until it leaves the window.
            log.warning("release of %s did not reach Redis; its lease will lapse", request_id)

    async def heartbeat(self) -> int:
        """Registers this gateway, renews held leases; returns the live gateway count."""
        settings = self._settings
        try:
            self._num_gateways = int(
                await self._call(
                    lambda: self._heartbeat(
                        keys=[f"{settings.key_prefix}:gateways"],
                        args=[
                            self._now_arg(),
                            round(settings.gateway_ttl_s * 1000),
                            self.gateway_id,
                        ],
                    ),
                    force=True,  # the heartbeat is the background probe: always try
                )
            )
            await self._forget_unanswered()
            by_bucket: dict[Bucket, list[str]] = {}
            for request_id, held in list(self._held.items()):
                if not held.is_local:
                    by_bucket.setdefault(held.bucket, []).append(request_id)
            for bucket, request_ids in by_bucket.items():
                await self._call(
                    partial(
                        self._renew,
                        keys=[self._keys(bucket)[3]],
                        args=[self._now_arg(), self._lease_ms(), *request_ids],
                    )
                )
        except StoreAway:
            pass  # the watch knows; the last count stands
        return self._num_gateways

    async def _forget_unanswered(self) -> None:
        by_bucket: dict[Bucket, list[str]] = {}
        for request_id, bucket in self._unanswered.items():
            by_bucket.setdefault(bucket, []).append(request_id)
        for bucket, request_ids in by_bucket.items():
            await self._call(partial(self._forget, keys=self._keys(bucket), args=request_ids))
            for request_id in request_ids:
                del self._unanswered[request_id]

    async def start(self) -> None:
        """Heartbeats now and then every `heartbeat_s` in the background."""
        await self.heartbeat()
        if self._task is None:
            self._task = asyncio.create_task(self._beat_forever(), name="admission-heartbeat")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        with contextlib.suppress(StoreAway):
            await self._call(
                lambda: self._redis.zrem(f"{self._settings.key_prefix}:gateways", self.gateway_id),
                force=True,
            )

    async def __aenter__(self) -> RedisLimiter:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def _beat_forever(self) -> None:
        while True:
            await asyncio.sleep(self._settings.heartbeat_s)
            await self.heartbeat()

    async def _take_shared(
        self, bucket: Bucket, limits: Limits, request_id: str, estimated_tokens: int
    ) -> WindowState:
        try:
            reply = await self._call(
                lambda: self._acquire_script(bucket, limits, request_id, estimated_tokens)
            )
        except StoreAway as exc:
            if exc.was_sent:  # Redis may have run it: taken back at the next heartbeat
                self._unanswered[request_id] = bucket
            raise
        reason, retry, num_requests, num_tokens, reset, num_running = (int(v) for v in reply)
        if reason == _DUPLICATE:
            raise DuplicateRequestId(f"request id {request_id!r} is already admitted")
        return WindowState(REASONS[reason], retry, num_requests, num_tokens, reset, num_running)

    def _acquire_script(
        self, bucket: Bucket, limits: Limits, request_id: str, estimated_tokens: int
    ) -> Awaitable[list[int]]:
        return self._acquire(
            keys=self._keys(bucket),
            args=[
                self._now_arg(),
                WINDOW_MS,
                limits.requests_per_minute,
                limits.tokens_per_minute,
                limits.max_concurrent,
                request_id,
                estimated_tokens,
                self._lease_ms(),
                CONCURRENCY_RETRY_MS,
            ],
        )

    def _take_local(self, bucket: Bucket, request_id: str, estimated_tokens: int) -> Admission:
        if self._settings.on_redis_error == "closed":
            raise AdmissionUnavailable("the rate-limit store is unreachable; try again shortly")
        account_id, model = bucket
        cached = self._overrides.get(account_id)
        overrides = cached[1] if cached is not None else AccountLimits()
        limits = self._settings.policy.resolve(overrides, model)
        check_size(estimated_tokens, limits)
        share = limits.share(self._num_gateways)
        clock = self._clock or time.time
        state = self._fallback.take(
            bucket, share, request_id, estimated_tokens, now_ms(clock), UNBOUNDED_LEASE_MS
        )
        if state.reason is None:
            self._held[request_id] = _Held(bucket, is_local=True)
        return build_admission(share, state)

    async def _load(self, account_id: str) -> AccountLimits:
        cached = self._overrides.get(account_id)
        now = self._monotonic()
        if cached is not None and now - cached[0] < self._settings.limits_cache_s:
            return cached[1]
        overrides = await self._call(lambda: self._store.load(account_id))
        if len(self._overrides) >= MAX_CACHED_ACCOUNTS and account_id not in self._overrides:
            # Oldest-inserted first; an evicted account is simply loaded again.
            del self._overrides[next(iter(self._overrides))]
        self._overrides.pop(account_id, None)
        self._overrides[account_id] = (now, overrides)
        return overrides

    async def _call(self, make: Callable[[], Awaitable[T]], *, force: bool = False) -> T:
        try:
            return await self._watch.call(make, force=force)
        except StoreAway as exc:
            if exc.was_sent:
                log.warning("redis call failed (%s); admission degrades to %s", exc, self._mode())
            raise

    def _mode(self) -> str:
        return "local shares" if self._settings.on_redis_error == "open" else "503s"

    def _keys(self, bucket: Bucket) -> list[str]:
        # One cluster hash tag per bucket: the script's keys must share a slot.
        account_id, model = bucket
        base = f"{self._settings.key_prefix}:rl:{{{account_id}|{model}}}"
        return [f"{base}:log", f"{base}:tokens", f"{base}:sum", f"{base}:leases"]

    def _lease_ms(self) -> int:
        return round(self._settings.lease_s * 1000)

    def _now_arg(self) -> str:
        return "" if self._clock is None else str(now_ms(self._clock))
