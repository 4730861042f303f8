"""The gateway's one config object, refused at construction when a field is out of range."""

from __future__ import annotations

import pytest

from gateway.settings import GatewaySettings


def test_the_defaults_are_valid() -> None:
    settings = GatewaySettings(internal_token="internal")
    assert (settings.admin_token, settings.queue_deadline_s, settings.max_body_bytes) == (
        None, 10.0, 4 * 1024 * 1024,
    )  # fmt: skip
    assert GatewaySettings(internal_token="t", queue_deadline_s=0).queue_deadline_s == 0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"internal_token": ""}, "internal_token must not be empty"),
        ({"node_silence_s": 0}, "node_silence_s must be > 0, got 0"),
        ({"max_queued": -1}, "max_queued must be > 0, got -1"),
        ({"reservation_ttl_s": 0.0}, "reservation_ttl_s must be > 0, got 0.0"),
        ({"queue_deadline_s": -0.5}, "queue_deadline_s must be >= 0, got -0.5"),
        ({"admin_token": "fifteen-chars-x"},
         "admin_token must be at least 16 characters (or None: no admin API)"),
    ],
)  # fmt: skip
def test_a_field_out_of_range_is_named(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as raised:
        GatewaySettings(**{"internal_token": "internal", **fields})  # type: ignore[arg-type]
    assert str(raised.value) == message
