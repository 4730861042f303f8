"""`LocalLimiter`, admission in one process: what differs from the shared limiter (the
answers they share: test_limiter.py)."""

from __future__ import annotations

import pytest

from gateway.admission import LimitPolicy, Limits, LocalLimiter, MemoryLimitStore
from gateway.errors import TokenLimitError

from .conftest import FakeClock


async def test_a_slot_is_freed_by_release_alone_never_by_time() -> None:
    clock = FakeClock(1_000.0)
    policy = LimitPolicy(default=Limits(requests_per_minute=100, max_concurrent=1))
    limiter = LocalLimiter(policy, clock=clock)
    assert (await limiter.acquire("acct", "m", "long", 1)).admitted
    clock.advance(24 * 3600)  # a day: no lease lapses in one process
    refused = await limiter.acquire("acct", "m", "next", 1)
    assert (refused.admitted, refused.reason) == (False, "concurrency")
    await limiter.release("acct", "m", "long", 1)
    assert (await limiter.acquire("acct", "m", "next", 1)).admitted


async def test_a_reservation_past_the_accounts_minute_is_never_admissible() -> None:
    store = MemoryLimitStore()
    await store.save("acct", Limits(tokens_per_minute=1_000))
    limiter = LocalLimiter(store=store)
    assert limiter.store is store
    assert (await limiter.acquire("acct", "m", "fits", 1_000)).admitted
    with pytest.raises(TokenLimitError) as raised:
        await limiter.acquire("acct", "m", "never", 1_001)
    assert raised.value.message == (
        "request reserves 1001 tokens (its prompt, estimated from its length, plus max_tokens), "
        "more than the account's limit of 1000 tokens per minute; shorten the prompt or lower "
        "max_tokens"
    )
    assert (await limiter.acquire("other", "m", "default", 1_001)).admitted  # 200 000 a minute
