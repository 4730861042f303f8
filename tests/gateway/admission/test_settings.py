"""The admission package's one config object, refused at construction when inconsistent."""

from __future__ import annotations

import pytest

from gateway.admission import AdmissionSettings, InvalidLimits


def test_a_gateway_is_live_for_three_heartbeats() -> None:
    assert AdmissionSettings().gateway_ttl_s == 15.0
    assert AdmissionSettings(heartbeat_s=2.0, lease_s=4.5).gateway_ttl_s == 6.0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"on_redis_error": "maybe"}, "on_redis_error must be 'open' or 'closed', got 'maybe'"),
        ({"redis_timeout_s": 0}, "redis_timeout_s must be a positive number of seconds, got 0"),
        ({"redis_retry_s": "1"}, "redis_retry_s must be a positive number of seconds, got '1'"),
        ({"limits_cache_s": -1}, "limits_cache_s must be >= 0, got -1"),
        ({"lease_s": 10.0}, "lease_s (10.0) must exceed twice heartbeat_s (5.0)"),
        ({"key_prefix": "a{b}"}, "key_prefix must be non-empty without braces or spaces, got 'a{b}'"),
        ({"key_prefix": ""}, "key_prefix must be non-empty without braces or spaces, got ''"),
    ],
)  # fmt: skip
def test_a_setting_out_of_range_is_named(fields: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidLimits) as raised:
        AdmissionSettings(**fields)  # type: ignore[arg-type]
    assert str(raised.value) == message
