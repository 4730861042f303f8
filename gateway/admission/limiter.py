"""The interface the gateway calls, whatever keeps the counters."""

from __future__ import annotations

from typing import Protocol

from gateway.admission.errors import InvalidRequest
from gateway.admission.limits import check_identifier
from gateway.admission.result import Admission


class Limiter(Protocol):
    """Admission for one request: take before forwarding, release when it ends.

    `acquire` reserves one request, `estimated_tokens` (prompt + max_tokens) and one
    concurrency slot, all or nothing. `release` frees the slot and corrects the token
    reservation to `actual_tokens`; it never raises for store trouble, so it is safe in
    a `finally`. Each request id is used once.
    """

    async def acquire(
        self, account_id: str, model: str, request_id: str, estimated_tokens: int
    ) -> Admission: ...

    async def release(
        self, account_id: str, model: str, request_id: str, actual_tokens: int
    ) -> None: ...


def check_request(account_id: str, model: str, request_id: str, num_tokens: int) -> None:
    """Validates the arguments both limiters take; raises InvalidRequest."""
    check_identifier("account id", account_id)
    check_identifier("model", model)
    check_identifier("request id", request_id)
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise InvalidRequest(f"token count must be a non-negative integer, got {num_tokens!r}")
