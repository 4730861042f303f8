"""Exact answers of both limiters (LocalLimiter and RedisLimiter on real Redis), fake clock,
and property tests of their arithmetic against a plain reference model."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field

import pytest
import redis.asyncio as redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.admission import (
    AdmissionSettings,
    DuplicateRequestId,
    InvalidRequest,
    LimitPolicy,
    Limits,
    LocalLimiter,
    RedisLimiter,
)
from gateway.errors import TokenLimitError

from .conftest import FakeClock, LimiterFactory, redis_url

POLICY = LimitPolicy(default=Limits(requests_per_minute=3, tokens_per_minute=100, max_concurrent=5))


async def test_admits_exactly_the_limit_then_answers_with_exact_headers(
    make_limiter: LimiterFactory,
) -> None:
    clock = FakeClock(1_000.0)
    limiter = make_limiter(POLICY, clock)

    first = await limiter.acquire("acct", "m", "r1", 10)
    assert first.admitted and first.reason is None and first.retry_after_s == 0.0
    assert dict(first.headers) == {
        "x-ratelimit-limit-requests": "3",
        "x-ratelimit-remaining-requests": "2",
        "x-ratelimit-reset-requests": "1m0s",
        "x-ratelimit-limit-tokens": "100",
        "x-ratelimit-remaining-tokens": "90",
        "x-ratelimit-reset-tokens": "1m0s",
    }
    clock.advance(10)
    assert (await limiter.acquire("acct", "m", "r2", 20)).admitted
    clock.advance(10.5)
    third = await limiter.acquire("acct", "m", "r3", 5)
    assert third.headers["x-ratelimit-remaining-requests"] == "0"
    assert third.headers["x-ratelimit-remaining-tokens"] == "65"

    clock.advance(0.25)  # t = 1020.75
    refused = await limiter.acquire("acct", "m", "r4", 5)
    assert (refused.admitted, refused.reason, refused.retry_after_s) == (False, "requests", 39.25)
    assert dict(refused.headers) == {
        "x-ratelimit-limit-requests": "3",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "59.75s",
        "x-ratelimit-limit-tokens": "100",
        "x-ratelimit-remaining-tokens": "65",
        "x-ratelimit-reset-tokens": "59.75s",
        "retry-after": "40",
        "retry-after-ms": "39250",
    }

    clock.advance(39.249)  # 1 ms before r1 leaves the window
    assert (await limiter.acquire("acct", "m", "r5", 5)).retry_after_s == 0.001
    clock.advance(0.001)  # r1 was admitted exactly 60 s ago: it no longer counts
    again = await limiter.acquire("acct", "m", "r6", 5)
    assert again.admitted
    assert again.headers["x-ratelimit-remaining-tokens"] == "70"  # 100 - (20 + 5 + 5)


async def test_release_corrects_the_token_reservation_to_real_usage(
    make_limiter: LimiterFactory,
) -> None:
    clock = FakeClock()
    limiter = make_limiter(POLICY, clock)
    assert (await limiter.acquire("acct", "m", "r1", 60)).admitted  # prompt 10 + max_tokens 50
    refused = await limiter.acquire("acct", "m", "r2", 50)
    assert (refused.reason, refused.headers["x-ratelimit-remaining-tokens"]) == ("tokens", "40")
    assert refused.retry_after_s == 60.0

    await limiter.release("acct", "m", "r1", 17)  # it used 17 tokens in the end
    after = await limiter.acquire("acct", "m", "r3", 50)
    assert after.admitted
    assert after.headers["x-ratelimit-remaining-tokens"] == "33"  # 100 - 17 - 50


async def test_token_retry_waits_for_just_enough_tokens_to_leave(
    make_limiter: LimiterFactory,
) -> None:
    clock = FakeClock(2_000.0)
    limiter = make_limiter(POLICY, clock)
    for i, tokens in enumerate((30, 30, 30)):
        assert (await limiter.acquire("acct", "m", f"r{i}", tokens)).admitted
        clock.advance(5)
    # t = 2015, 90 used: 70 needs two entries gone, the second leaves at 2005 + 60.
    refused = await limiter.acquire("acct", "m", "big", 70)
    assert (refused.reason, refused.retry_after_s) == ("tokens", 50.0)
    # When several limits refuse, the answer is the longest wait (here requests: 45 s < 50 s).
    assert refused.headers["retry-after"] == "50"


async def test_concurrency_cap_and_freed_slot_reuse(make_limiter: LimiterFactory) -> None:
    policy = LimitPolicy(
        default=Limits(requests_per_minute=100, tokens_per_minute=1000, max_concurrent=2)
    )
    limiter = make_limiter(policy, FakeClock())
    assert (await limiter.acquire("acct", "m", "a", 1)).admitted
    assert (await limiter.acquire("acct", "m", "b", 1)).admitted
    refused = await limiter.acquire("acct", "m", "c", 1)
    assert (refused.admitted, refused.reason, refused.retry_after_s) == (False, "concurrency", 1.0)
    assert refused.headers["retry-after"] == "1"
    await limiter.release("acct", "m", "a", 1)
    assert (await limiter.acquire("acct", "m", "c", 1)).admitted
    # Another account and another model are separate buckets.
    assert (await limiter.acquire("other", "m", "d", 1)).admitted
    assert (await limiter.acquire("acct", "m2", "e", 1)).admitted


async def test_overrides_resolve_most_specific_first(make_limiter: LimiterFactory) -> None:
    policy = LimitPolicy(
        default=Limits(requests_per_minute=5),
        per_model={"big": Limits(requests_per_minute=4)},
    )
    limiter = make_limiter(policy, FakeClock())
    store = make_limiter.store

    async def limit_of(account: str, model: str, request_id: str) -> str:
        return (await limiter.acquire(account, model, request_id, 1)).headers[
            "x-ratelimit-limit-requests"
        ]

    assert await limit_of("acct", "small", "1") == "5"
    assert await limit_of("acct", "big", "2") == "4"
    await store.save("acct", Limits(requests_per_minute=3))
    assert await limit_of("acct", "big", "3") == "3"
    await store.save("acct", Limits(requests_per_minute=2), model="big")
    assert await limit_of("acct", "big", "4") == "2"
    assert await limit_of("acct", "small", "5") == "3"
    assert await limit_of("someone-else", "big", "6") == "4"


async def test_bad_input_gets_typed_errors(make_limiter: LimiterFactory) -> None:
    limiter = make_limiter(POLICY, FakeClock())
    with pytest.raises(TokenLimitError, match="reserves 101 tokens"):
        await limiter.acquire("acct", "m", "r1", 101)
    with pytest.raises(InvalidRequest, match="account id"):
        await limiter.acquire("has space", "m", "r1", 1)
    with pytest.raises(InvalidRequest, match="model"):
        await limiter.acquire("acct", "{m}", "r1", 1)
    with pytest.raises(InvalidRequest, match="token count"):
        await limiter.acquire("acct", "m", "r1", -1)
    assert (await limiter.acquire("acct", "m", "r1", 1)).admitted
    with pytest.raises(DuplicateRequestId):
        await limiter.acquire("acct", "m", "r1", 1)


async def test_release_of_unknown_request_is_a_no_op(make_limiter: LimiterFactory) -> None:
    limiter = make_limiter(POLICY, FakeClock())
    await limiter.release("acct", "m", "never-admitted", 5)
    assert (await limiter.acquire("acct", "m", "r1", 1)).headers[
        "x-ratelimit-remaining-requests"
    ] == "2"


# -- the limiters against a plain reference model -------------------------------------------
# For any limits and any interleaving of acquires, releases and clock moves, the limiter
# admits exactly when the reference does (so it never admits past a limit and never refuses
# below one), names the same reason and asks for the same wait.

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
