"""Exact answers of both limiters (LocalLimiter and RedisLimiter on real Redis), fake clock."""

from __future__ import annotations

import pytest

from gateway.admission import (
    DuplicateRequestId,
    InvalidRequest,
    LimitPolicy,
    Limits,
)
from gateway.errors import TokenLimitError

from .conftest import FakeClock, LimiterFactory

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
