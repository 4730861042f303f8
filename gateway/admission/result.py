"""The outcome of one check-and-take, and the rate-limit headers that describe it."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from gateway.admission.limits import Limits

Reason = Literal["requests", "tokens", "concurrency"]

# The per-minute window every limit is counted over, in milliseconds.
WINDOW_MS = 60_000
# A slot frees when some other request ends, which nobody can predict; clients retry
# after this long.
CONCURRENCY_RETRY_MS = 1_000
# Official clients ignore a Retry-After above 60 s, so no answer ever asks for more.
MAX_RETRY_AFTER_S = 60

# Order the limiter scripts number reasons in (0 = admitted).
REASONS: tuple[Reason | None, ...] = (None, "requests", "tokens", "concurrency")


@dataclass(frozen=True, slots=True)
class WindowState:
    """What a window looked like right after a check-and-take (all times in ms)."""

    reason: Reason | None  # None: admitted
    retry_after_ms: int  # 0 when admitted
    num_requests: int  # requests counted in the window, this one included when admitted
    num_tokens: int  # tokens counted in the window, this reservation included when admitted
    reset_ms: int  # until every entry now in the window has left it
    num_running: int  # concurrency slots held, this one included when admitted


@dataclass(frozen=True, slots=True)
class Admission:
    """The limiter's answer. `headers` go on the response whether or not it was admitted."""

    admitted: bool
    reason: Reason | None
    retry_after_s: float
    headers: Mapping[str, str] = field(default_factory=dict)


def format_duration(ms: int) -> str:
    """Go-style duration as OpenAI's x-ratelimit-reset-* headers use: 250ms, 1.5s, 1m0s."""
    if ms <= 0:
        return "0s"
    if ms < 1_000:
        return f"{ms}ms"
    if ms < 60_000:
        return f"{ms / 1000:g}s"
    minutes, rest = divmod(ms, 60_000)
    return f"{minutes}m{rest / 1000:g}s"


def build_admission(limits: Limits, state: WindowState) -> Admission:
    """Turns a window state into the answer and its headers.

    reset-* follows OpenAI's meaning: the time until the limit is back to its initial
    state, i.e. until the newest entry leaves the window. Requests and tokens share one
    log (every request reserves its tokens when admitted) so both resets are equal.
    """
    reset = format_duration(state.reset_ms)
    headers = {
        "x-ratelimit-limit-requests": str(limits.requests_per_minute),
        "x-ratelimit-remaining-requests": str(
            max(0, limits.requests_per_minute - state.num_requests)
        ),
        "x-ratelimit-reset-requests": reset,
        "x-ratelimit-limit-tokens": str(limits.tokens_per_minute),
        "x-ratelimit-remaining-tokens": str(max(0, limits.tokens_per_minute - state.num_tokens)),
        "x-ratelimit-reset-tokens": reset,
    }
    if state.reason is None:
        return Admission(admitted=True, reason=None, retry_after_s=0.0, headers=headers)
    retry_ms = min(max(state.retry_after_ms, 1), MAX_RETRY_AFTER_S * 1000)
    headers["retry-after"] = str(min(max(1, math.ceil(retry_ms / 1000)), MAX_RETRY_AFTER_S))
    headers["retry-after-ms"] = str(retry_ms)
    return Admission(
        admitted=False, reason=state.reason, retry_after_s=retry_ms / 1000, headers=headers
    )
