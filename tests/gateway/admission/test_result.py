"""An admission's answer and its rate-limit headers, from a window's state."""

from __future__ import annotations

import pytest

from gateway.admission import Limits
from gateway.admission.result import Admission, WindowState, build_admission, format_duration

LIMITS = Limits(requests_per_minute=3, tokens_per_minute=100, max_concurrent=5)


@pytest.mark.parametrize(
    ("ms", "text"),
    [(-5, "0s"), (0, "0s"), (250, "250ms"), (1_500, "1.5s"), (59_999, "59.999s"),
     (60_000, "1m0s"), (90_500, "1m30.5s")],
)  # fmt: skip
def test_durations_are_written_as_go_writes_them(ms: int, text: str) -> None:
    assert format_duration(ms) == text


def test_an_admitted_request_gets_the_limits_and_what_remains() -> None:
    state = WindowState(None, 0, num_requests=1, num_tokens=10, reset_ms=60_000, num_running=1)
    assert build_admission(LIMITS, state) == Admission(
        admitted=True,
        reason=None,
        retry_after_s=0.0,
        headers={
            "x-ratelimit-limit-requests": "3",
            "x-ratelimit-remaining-requests": "2",
            "x-ratelimit-reset-requests": "1m0s",
            "x-ratelimit-limit-tokens": "100",
            "x-ratelimit-remaining-tokens": "90",
            "x-ratelimit-reset-tokens": "1m0s",
        },
    )


def test_a_refused_request_is_told_when_to_retry() -> None:
    state = WindowState("tokens", 58_000, num_requests=2, num_tokens=90, reset_ms=59_000,
                        num_running=2)  # fmt: skip
    answer = build_admission(LIMITS, state)
    assert (answer.admitted, answer.reason, answer.retry_after_s) == (False, "tokens", 58.0)
    assert answer.headers == {
        "x-ratelimit-limit-requests": "3",
        "x-ratelimit-remaining-requests": "1",
        "x-ratelimit-reset-requests": "59s",
        "x-ratelimit-limit-tokens": "100",
        "x-ratelimit-remaining-tokens": "10",
        "x-ratelimit-reset-tokens": "59s",
        "retry-after": "58",
        "retry-after-ms": "58000",
    }


@pytest.mark.parametrize(
    ("retry_after_ms", "retry_after", "retry_after_header_ms", "seconds"),
    [(0, "1", "1", 0.001), (1_200, "2", "1200", 1.2), (120_000, "60", "60000", 60.0)],
)
def test_a_retry_is_at_least_a_millisecond_and_at_most_60_s(
    retry_after_ms: int, retry_after: str, retry_after_header_ms: str, seconds: float
) -> None:
    """Official clients ignore a Retry-After above 60 s."""
    state = WindowState("requests", retry_after_ms, 5, 0, 0, 0)
    answer = build_admission(LIMITS, state)
    assert (answer.headers["retry-after"], answer.headers["retry-after-ms"]) == (
        retry_after, retry_after_header_ms,
    )  # fmt: skip
    assert answer.retry_after_s == seconds
    assert answer.headers["x-ratelimit-remaining-requests"] == "0"  # 5 counted, limit 3
    assert answer.headers["x-ratelimit-reset-requests"] == "0s"
