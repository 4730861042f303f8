"""Admission kept in this process: `edgeserve up`, where one gateway is the whole fleet."""

from __future__ import annotations

import time
from collections.abc import Callable

from gateway.admission.limiter import check_request
from gateway.admission.limits import LimitPolicy, Limits
from gateway.admission.result import Admission, build_admission
from gateway.admission.store import LimitStore, MemoryLimitStore
from gateway.admission.window import LocalWindows
from gateway.errors import TokenLimitError

# In one process a slot's holder cannot vanish without the limiter vanishing with it,
# so local slots never lapse; they are freed by release alone.
UNBOUNDED_LEASE_MS = 2**62


def now_ms(clock: Callable[[], float]) -> int:
    return round(clock() * 1000)


def check_size(estimated_tokens: int, limits: Limits) -> None:
    """TokenLimitError when the reservation alone exceeds the account's tokens per minute."""
    if estimated_tokens > limits.tokens_per_minute:
        raise TokenLimitError(
            f"request reserves {estimated_tokens} tokens (its prompt, estimated from its "
            f"length, plus max_tokens), more than the account's limit of "
            f"{limits.tokens_per_minute} tokens per minute; shorten the prompt or lower "
            f"max_tokens"
        )


class LocalLimiter:
    """The same limits and answers as RedisLimiter, counted in this process."""

    def __init__(
        self,
        policy: LimitPolicy | None = None,
        store: LimitStore | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._policy = policy or LimitPolicy()
        self._store = store or MemoryLimitStore()
        self._clock = clock
        self._windows = LocalWindows()

    @property
    def store(self) -> LimitStore:
        return self._store

    async def acquire(
        self, account_id: str, model: str, request_id: str, estimated_tokens: int
    ) -> Admission:
        check_request(account_id, model, request_id, estimated_tokens)
        limits = self._policy.resolve(await self._store.load(account_id), model)
        check_size(estimated_tokens, limits)
        state = self._windows.take(
            (account_id, model),
            limits,
            request_id,
            estimated_tokens,
            now_ms(self._clock),
            UNBOUNDED_LEASE_MS,
        )
        return build_admission(limits, state)

    async def release(
        self, account_id: str, model: str, request_id: str, actual_tokens: int
    ) -> None:
        check_request(account_id, model, request_id, actual_tokens)
        self._windows.release((account_id, model), request_id, actual_tokens)
