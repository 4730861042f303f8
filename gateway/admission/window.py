"""Sliding-window-log limits kept in this process (the twin of lua/acquire.lua).

Why a sliding log and not GCRA or fixed windows: the promise is "at most N in any
60 s, and a request is refused only when N were admitted in the 60 s before it".
A fixed window admits 2N across a boundary; GCRA with burst N admits N at once and
then one every 60/N s, i.e. up to 2N-1 in a 60 s span; a sliding counter is an
estimate. The log is exact, and its size is bounded by requests_per_minute.

Every admitted request is one log entry (time, request id, tokens): the request
count is the number of entries younger than 60 s and the token count is their sum,
kept as a running total. Concurrency slots are leases (request id -> expiry) so a
slot whose holder vanished frees itself.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from gateway.admission.errors import DuplicateRequestId
from gateway.admission.limits import Limits
from gateway.admission.result import CONCURRENCY_RETRY_MS, REASONS, WINDOW_MS, WindowState


@dataclass
class _Bucket:
    log: deque[tuple[int, str]] = field(default_factory=deque)  # (admitted at ms, request id)
    tokens: dict[str, int] = field(default_factory=dict)  # request id -> tokens counted
    num_tokens: int = 0  # sum of `tokens` over the log
    leases: dict[str, int] = field(default_factory=dict)  # request id -> lease expiry ms

    def expire(self, now_ms: int) -> None:
        cutoff = now_ms - WINDOW_MS
        while self.log and self.log[0][0] <= cutoff:
            _, request_id = self.log.popleft()
            self.num_tokens -= self.tokens.pop(request_id)
        for request_id in [r for r, expiry in self.leases.items() if expiry <= now_ms]:
            del self.leases[request_id]

    def is_empty(self) -> bool:
        return not self.log and not self.leases


class LocalWindows:
    """Check-and-take over many (account, model) buckets; synchronous, so atomic in one loop."""

    # Buckets idle for a whole window are dropped every this many takes, so an account
    # seen once does not stay in memory.
    SWEEP_EVERY = 1024

    def __init__(self) -> None:
        self._buckets: dict[tuple[str, str], _Bucket] = {}
        self._num_takes = 0

    def take(
        self,
        bucket: tuple[str, str],
        limits: Limits,
        request_id: str,
        estimated_tokens: int,
        now_ms: int,
        lease_ms: int,
    ) -> WindowState:
        self._num_takes += 1
        if self._num_takes % self.SWEEP_EVERY == 0:
            self.sweep(now_ms)
        b = self._buckets.setdefault(bucket, _Bucket())
        b.expire(now_ms)
        if request_id in b.tokens or request_id in b.leases:
            raise DuplicateRequestId(f"request id {request_id!r} is already admitted")
        reason, retry = 0, 0
        num_requests = len(b.log)
        if num_requests >= limits.requests_per_minute:
            # The entry whose departure brings the count below the limit.
            at, _ = b.log[num_requests - limits.requests_per_minute]
            reason, retry = 1, at + WINDOW_MS - now_ms
        if b.num_tokens + estimated_tokens > limits.tokens_per_minute:
            need, freed, wait = (
                b.num_tokens + estimated_tokens - limits.tokens_per_minute,
                0,
                WINDOW_MS,
            )
            for at, request_id_in_log in b.log:
                freed += b.tokens[request_id_in_log]
                if freed >= need:
                    wait = at + WINDOW_MS - now_ms
                    break
            if wait > retry:
                reason, retry = 2, wait
        if len(b.leases) >= limits.max_concurrent and (reason == 0 or retry < CONCURRENCY_RETRY_MS):
            reason, retry = 3, CONCURRENCY_RETRY_MS
        if reason == 0:
            b.log.append((now_ms, request_id))
            b.tokens[request_id] = estimated_tokens
            b.num_tokens += estimated_tokens
            b.leases[request_id] = now_ms + lease_ms
        reset = b.log[-1][0] + WINDOW_MS - now_ms if b.log else 0
        return WindowState(
            reason=REASONS[reason],
            retry_after_ms=retry,
            num_requests=len(b.log),
            num_tokens=b.num_tokens,
            reset_ms=reset,
            num_running=len(b.leases),
        )

    def release(self, bucket: tuple[str, str], request_id: str, actual_tokens: int) -> bool:
        """Frees the slot and corrects the reservation; False when the id held nothing."""
        b = self._buckets.get(bucket)
        if b is None:
            return False
        held = b.leases.pop(request_id, None) is not None
        if request_id in b.tokens:
            b.num_tokens += actual_tokens - b.tokens[request_id]
            b.tokens[request_id] = actual_tokens
            held = True
        if b.is_empty():
            del self._buckets[bucket]
        return held

    def sweep(self, now_ms: int) -> None:
        for key, b in list(self._buckets.items()):
            b.expire(now_ms)
            if b.is_empty():
                del self._buckets[key]

    def num_buckets(self) -> int:
        return len(self._buckets)
