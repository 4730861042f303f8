"""Property tests of the limiter arithmetic against a plain reference model.

For any limits and any interleaving of acquires, releases and clock moves, the
limiter admits exactly when the reference does (so it never admits past a limit and
never refuses below one), names the same reason and asks for the same wait.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field

import redis.asyncio as redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.admission import AdmissionSettings, LimitPolicy, Limits, LocalLimiter, RedisLimiter

from .conftest import FakeClock, redis_url

W = 60_000  # the window, ms


@dataclass
class Reference:
    limits: Limits
    entries: list[tuple[int, str, int]] = field(default_factory=list)  # (at ms, id, tokens)
    running: set[str] = field(default_factory=set)

    def decide(self, now: int, tokens: int) -> tuple[str | None, int]:
        live = [e for e in self.entries if e[0] > now - W]
        used = sum(e[2] for e in live)
        waits: list[tuple[int, int, str]] = []  # (wait, -priority, reason)
        if len(live) >= self.limits.requests_per_minute:
            times = sorted(e[0] for e in live)
            at = times[len(live) - self.limits.requests_per_minute]
            waits.append((at + W - now, -1, "requests"))
        if used + tokens > self.limits.tokens_per_minute:
            # The earliest moment when what is still in the window leaves room.
            wait = min(
                t + W - now
                for t, _, _ in live
                if sum(e[2] for e in live if e[0] > t) + tokens <= self.limits.tokens_per_minute
            )
            waits.append((wait, -2, "tokens"))
        if len(self.running) >= self.limits.max_concurrent:
            waits.append((1_000, -3, "concurrency"))
        if not waits:
            return None, 0
        wait, _, reason = max(waits)
        return reason, wait

    def admit(self, now: int, request_id: str, tokens: int) -> None:
        self.entries.append((now, request_id, tokens))
        self.running.add(request_id)

    def release(self, request_id: str, actual: int) -> None:
        self.running.discard(request_id)
        self.entries = [(t, r, actual if r == request_id else n) for t, r, n in self.entries]

    def count_at(self, now: int) -> int:
        return sum(1 for e in self.entries if e[0] > now - W)


limits_strategy = st.builds(
    Limits,
    requests_per_minute=st.integers(1, 6),
    tokens_per_minute=st.integers(1, 60),
    max_concurrent=st.integers(1, 4),
)
# (ms to move the clock, release? , tokens or actual tokens, which running request)
op_strategy = st.tuples(
    st.sampled_from([0, 1, 250, 5_000, 20_000, 59_999, 60_000]),
    st.booleans(),
    st.integers(0, 60),
    st.integers(0, 10),
)


async def check_against_reference(
    limiter: LocalLimiter | RedisLimiter,
    clock: FakeClock,
    limits: Limits,
    ops: list[tuple[int, bool, int, int]],
) -> None:
    ref = Reference(limits)
    for n, (step_ms, is_release, amount, pick) in enumerate(ops):
        clock.advance(step_ms / 1000)
        now = round(clock() * 1000)
        if is_release and ref.running:
            request_id = sorted(ref.running)[pick % len(ref.running)]
            await limiter.release("acct", "m", request_id, amount)
            ref.release(request_id, amount)
            continue
        tokens = min(amount, limits.tokens_per_minute)
        request_id = f"r{n}"
        answer = await limiter.acquire("acct", "m", request_id, tokens)
        reason, wait = ref.decide(now, tokens)
        assert (answer.reason, round(answer.retry_after_s * 1000)) == (reason, wait)
        assert answer.admitted == (reason is None)
        if answer.admitted:
            ref.admit(now, request_id, tokens)
        remaining = limits.requests_per_minute - ref.count_at(now)
        assert answer.headers["x-ratelimit-remaining-requests"] == str(max(0, remaining))


@settings(max_examples=300, deadline=None)
@given(limits=limits_strategy, ops=st.lists(op_strategy, max_size=40))
def test_local_limiter_matches_the_reference(
    limits: Limits, ops: list[tuple[int, bool, int, int]]
) -> None:
    clock = FakeClock(1_000.0)
    limiter = LocalLimiter(LimitPolicy(default=limits), clock=clock)
    asyncio.run(check_against_reference(limiter, clock, limits, ops))


async def _run_on_redis(limits: Limits, ops: list[tuple[int, bool, int, int]]) -> None:
    client = redis.Redis.from_url(redis_url(), socket_timeout=5)
    prefix = f"test-admission-prop-{uuid.uuid4().hex[:12]}"
    clock = FakeClock(1_000.0)
    # Leases outlast the whole run: a live gateway renews them (lapsing is test_redis_limiter's job).
    settings_ = AdmissionSettings(
        policy=LimitPolicy(default=limits), key_prefix=prefix, lease_s=3_600, redis_timeout_s=10.0
    )
    try:
        limiter = RedisLimiter(client, settings_, clock=clock)
        await check_against_reference(limiter, clock, limits, ops)
    finally:
        keys = [key async for key in client.scan_iter(match=f"{prefix}:*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(limits=limits_strategy, ops=st.lists(op_strategy, max_size=25))
def test_redis_limiter_matches_the_reference(
    limits: Limits, ops: list[tuple[int, bool, int, int]]
) -> None:
    asyncio.run(_run_on_redis(limits, ops))
