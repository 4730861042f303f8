from __future__ import annotations

import pytest

from billing.errors import InvalidUsageEvent
from billing.events import UsageEvent
from tests.billing.samples import DAY1, make_event


def test_fields_round_trip_exactly() -> None:
    event = make_event("req-1", cached_tokens=40, started_at=DAY1 + 0.1, ended_at=DAY1 + 0.3)
    fields = event.to_fields()
    assert fields == {
        "request_id": "req-1",
        "account_id": "acct-a",
        "model": "@cf/huggingface/smollm2-135m-instruct",
        "node_id": "node-1",
        "input_tokens": "100",
        "output_tokens": "20",
        "cached_tokens": "40",
        "started_at": repr(DAY1 + 0.1),
        "ended_at": repr(DAY1 + 0.3),
        "status": "ok",
    }
    assert UsageEvent.from_fields(fields) == event
    as_bytes = {k.encode(): v.encode() for k, v in fields.items()}
    assert UsageEvent.from_fields(as_bytes) == event


def test_starts_and_node_records_hold_their_status_where_an_ends_reader_finds_none() -> None:
    """A reader that knows ends alone (a worker not yet upgraded) must not bill a start as
    the request's end: it finds no `status`, and dead-letters the entry."""
    for kind in ("start", "node"):
        event = make_event("req-1", kind=kind, status="cancelled")
        fields = event.to_fields()
        assert "status" not in fields
        assert (fields["kind"], fields["outcome"]) == (kind, "cancelled")
        assert UsageEvent.from_fields(fields) == event
        ends_only = {k: v for k, v in fields.items() if k != "kind"}  # as such a reader sees it
        with pytest.raises(InvalidUsageEvent, match="usage event lacks fields: status"):
            UsageEvent.from_fields(ends_only)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"request_id": ""}, "request_id must not be empty"),
        ({"account_id": 7}, "account_id must be a string, got int"),
        (
            {"input_tokens": -1},
            "input_tokens must be an integer in [0, 1099511627776], got -1",
        ),
        (
            {"output_tokens": True},
            "output_tokens must be an integer in [0, 1099511627776], got True",
        ),
        (
            {"input_tokens": 2**64, "cached_tokens": 0},  # past the ledger's BIGINT
            "input_tokens must be an integer in [0, 1099511627776], got 18446744073709551616",
        ),
        (
            {"input_tokens": 2**40 + 1, "cached_tokens": 0},  # a report's SUM could overflow
            "input_tokens must be an integer in [0, 1099511627776], got 1099511627777",
        ),
        ({"request_id": "r" * 257}, "request_id must be at most 256 characters"),
        ({"model": "m\x00"}, "model must be UTF-8 text without NUL, got 'm\\x00'"),
        ({"node_id": "n\ud800"}, "node_id must be UTF-8 text without NUL, got 'n\\ud800'"),
        (
            {"ended_at": 1793620801000.0},  # milliseconds: past the year 9999
            "ended_at must be epoch seconds in [0, 253402300799], got 1793620801000.0",
        ),
        ({"cached_tokens": 101}, "cached_tokens (101) exceeds input_tokens (100)"),
        ({"ended_at": DAY1 - 1}, "is before started_at"),
        ({"started_at": float("nan")}, "started_at must be epoch seconds in [0, 253402300799]"),
        ({"status": "done"}, "status must be one of ['cancelled', 'error', 'ok'], got 'done'"),
    ],
)
def test_bad_events_are_rejected_with_the_field_named(
    overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(InvalidUsageEvent) as info:
        make_event("req-1", **overrides)
    assert message in str(info.value)


def test_from_fields_names_missing_and_non_numeric_fields() -> None:
    fields = make_event("req-1").to_fields()
    del fields["status"], fields["node_id"]
    with pytest.raises(InvalidUsageEvent, match="lacks fields: node_id, status"):
        UsageEvent.from_fields(fields)
    fields = make_event("req-1").to_fields() | {"output_tokens": "many"}
    with pytest.raises(InvalidUsageEvent, match="non-numeric"):
        UsageEvent.from_fields(fields)
    as_bytes = {k.encode(): v.encode() for k, v in make_event("req-1").to_fields().items()}
    as_bytes[b"model"] = b"\xff\xfe"
    with pytest.raises(InvalidUsageEvent, match="a field that is not UTF-8"):
        UsageEvent.from_fields(as_bytes)


def test_empty_node_is_allowed_for_requests_that_never_reached_one() -> None:
    assert make_event("req-1", node_id="", status="error").node_id == ""
