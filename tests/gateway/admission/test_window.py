"""The in-process sliding-window log (`LocalWindows`): exact states, retries and leases."""

from __future__ import annotations

import pytest

from gateway.admission import DuplicateRequestId, Limits
from gateway.admission.result import WindowState
from gateway.admission.window import LocalWindows

BUCKET = ("acct", "m")
LEASE_MS = 30_000


def test_requests_past_the_limit_wait_for_the_oldest_to_leave_the_window() -> None:
    windows = LocalWindows()
    limits = Limits(requests_per_minute=2, tokens_per_minute=100, max_concurrent=10)
    assert windows.take(BUCKET, limits, "r1", 10, 1_000, LEASE_MS) == WindowState(
        reason=None, retry_after_ms=0, num_requests=1, num_tokens=10, reset_ms=60_000,
        num_running=1,
    )  # fmt: skip
    assert windows.take(BUCKET, limits, "r2", 20, 2_000, LEASE_MS) == WindowState(
        reason=None, retry_after_ms=0, num_requests=2, num_tokens=30, reset_ms=60_000,
        num_running=2,
    )  # fmt: skip
    # r1 leaves at 61 000: 58 s from now; the window resets when r2 leaves, at 62 000.
    assert windows.take(BUCKET, limits, "r3", 5, 3_000, LEASE_MS) == WindowState(
        reason="requests", retry_after_ms=58_000, num_requests=2, num_tokens=30,
        reset_ms=59_000, num_running=2,
    )  # fmt: skip
    # At 61 000 r1 has left the window, and both leases (to 31 000 and 32 000) have lapsed.
    assert windows.take(BUCKET, limits, "r3", 5, 61_000, LEASE_MS) == WindowState(
        reason=None, retry_after_ms=0, num_requests=2, num_tokens=25, reset_ms=60_000,
        num_running=1,
    )  # fmt: skip


def test_tokens_past_the_limit_wait_for_just_enough_to_leave_and_release_corrects_them() -> None:
    windows = LocalWindows()
    limits = Limits(requests_per_minute=10, tokens_per_minute=100, max_concurrent=10)
    windows.take(BUCKET, limits, "a", 60, 1_000, LEASE_MS)
    windows.take(BUCKET, limits, "b", 30, 2_000, LEASE_MS)
    # 90 + 20 is 10 over: a's 60 leaving is enough, at 61 000.
    assert windows.take(BUCKET, limits, "c", 20, 3_000, LEASE_MS) == WindowState(
        reason="tokens", retry_after_ms=58_000, num_requests=2, num_tokens=90, reset_ms=59_000,
        num_running=2,
    )  # fmt: skip
    assert windows.release(BUCKET, "a", 5) is True  # a used 5 of the 60 it reserved
    assert windows.take(BUCKET, limits, "c", 20, 3_000, LEASE_MS) == WindowState(
        reason=None, retry_after_ms=0, num_requests=3, num_tokens=55, reset_ms=60_000,
        num_running=2,
    )  # fmt: skip


def test_a_slot_frees_on_release_or_when_its_lease_lapses() -> None:
    windows = LocalWindows()
    limits = Limits(requests_per_minute=10, tokens_per_minute=100, max_concurrent=1)
    windows.take(BUCKET, limits, "a", 1, 0, LEASE_MS)
    refused = windows.take(BUCKET, limits, "b", 1, 10, LEASE_MS)
    assert (refused.reason, refused.retry_after_ms, refused.num_running) == (
        "concurrency",
        1_000,
        1,
    )
    assert windows.release(BUCKET, "a", 1) is True
    assert windows.take(BUCKET, limits, "b", 1, 20, LEASE_MS).reason is None

    other = ("acct", "m2")
    windows.take(other, limits, "x", 1, 0, 5_000)
    assert windows.take(other, limits, "y", 1, 4_999, 5_000).reason == "concurrency"
    assert windows.take(other, limits, "y", 1, 5_000, 5_000).reason is None  # x's lease lapsed


def test_a_request_id_is_admitted_once_and_releasing_an_unknown_one_holds_nothing() -> None:
    windows = LocalWindows()
    limits = Limits()
    windows.take(BUCKET, limits, "r1", 1, 0, LEASE_MS)
    with pytest.raises(DuplicateRequestId, match="request id 'r1' is already admitted"):
        windows.take(BUCKET, limits, "r1", 1, 1, LEASE_MS)
    assert windows.release(BUCKET, "never", 0) is False
    assert windows.release(("acct", "unseen"), "r1", 0) is False


def test_a_bucket_is_dropped_once_its_window_and_leases_are_empty() -> None:
    windows = LocalWindows()
    windows.take(BUCKET, Limits(), "r1", 1, 0, 1_000)
    assert windows.release(BUCKET, "r1", 1) is True
    assert windows.num_buckets() == 1  # r1 still counts in the window
    windows.sweep(59_999)
    assert windows.num_buckets() == 1
    windows.sweep(60_000)
    assert windows.num_buckets() == 0
