"""One ledger suite, run on SQLite and on PostgreSQL."""

from __future__ import annotations

import sqlite3
import threading
import time
from datetime import date

import pytest

from billing.ledger import DailyUsage, Ledger
from tests.billing.samples import DAY1, DAY3, make_event

SMOL = "@cf/huggingface/smollm2-135m-instruct"


def test_insert_is_new_once_and_a_replay_changes_nothing(ledger: Ledger) -> None:
    first = make_event("req-1", input_tokens=100, output_tokens=20)
    assert ledger.insert(first) is True
    replay = make_event("req-1", input_tokens=999, output_tokens=999)
    assert ledger.insert(replay) is False
    assert ledger.get("req-1") == first
    assert ledger.count() == 1
    assert ledger.get("req-404") is None


def test_insert_many_reports_newness_per_event_including_repeats_in_one_batch(
    ledger: Ledger,
) -> None:
    ledger.insert(make_event("req-1"))
    batch = [make_event("req-1"), make_event("req-2"), make_event("req-3"), make_event("req-2")]
    assert ledger.insert_many(batch) == [False, True, True, False]
    assert ledger.count() == 3
    assert ledger.insert_many([]) == []


def test_daily_usage_groups_by_account_model_and_utc_day_of_the_end(ledger: Ledger) -> None:
    ledger.insert_many(
        [
            make_event("a1", input_tokens=100, cached_tokens=10, output_tokens=5),
            make_event("a2", input_tokens=50, cached_tokens=0, output_tokens=7, status="cancelled"),
            # started on day 1, ended just after midnight UTC: billed on day 2
            make_event("a3", started_at=DAY1 + 43_000, ended_at=DAY1 + 43_201, output_tokens=1),
            make_event("a4", model="moe-small", ended_at=DAY1 + 2, input_tokens=3, output_tokens=4),
            make_event("b1", account_id="acct-b", input_tokens=8, output_tokens=9),
            # failed on our side: kept in the ledger, never billed
            make_event("b2", account_id="acct-b", input_tokens=6, output_tokens=3, status="error"),
            make_event("a5", started_at=DAY3, ended_at=DAY3 + 1),
        ]
    )
    assert ledger.count() == 7 and ledger.missing(["b2"]) == set()
    d1, d2 = date(2026, 11, 2), date(2026, 11, 3)
    assert ledger.daily_usage(d1, d2) == [
        DailyUsage("acct-a", SMOL, d1, 2, 150, 10, 12),
        DailyUsage("acct-a", "moe-small", d1, 1, 3, 0, 4),
        DailyUsage("acct-b", SMOL, d1, 1, 8, 0, 9),
        DailyUsage("acct-a", SMOL, d2, 1, 100, 0, 1),
    ]
    assert ledger.daily_usage(d1, d1, account_id="acct-b") == [
        DailyUsage("acct-b", SMOL, d1, 1, 8, 0, 9)
    ]
    assert ledger.daily_usage(date(2026, 11, 4), date(2026, 11, 4)) == [
        DailyUsage("acct-a", SMOL, date(2026, 11, 4), 1, 100, 0, 20)
    ]
    assert ledger.daily_usage(d1, d2, account_id="acct-z") == []


def test_missing_returns_ids_without_rows_across_chunks(ledger: Ledger) -> None:
    ledger.insert_many([make_event(f"req-{i}") for i in range(0, 1200, 2)])
    wanted = [f"req-{i}" for i in range(1200)]
    assert ledger.missing(wanted) == {f"req-{i}" for i in range(1, 1200, 2)}
    assert ledger.missing([]) == set()


def test_rows_and_ended_since_read_back_exact_events_across_chunks(ledger: Ledger) -> None:
    events = [make_event(f"req-{i:04d}", ended_at=DAY1 + i / 3) for i in range(0, 1200, 2)]
    ledger.insert_many(events)
    found = ledger.rows(f"req-{i:04d}" for i in range(1200))
    assert found == {e.request_id: e for e in events}  # floats exact, odd ids absent
    assert ledger.ended_since(DAY1 + 1194 / 3) == ["req-1194", "req-1196", "req-1198"]


def test_concurrent_inserts_of_the_same_ids_bill_each_once(ledger: Ledger) -> None:
    events = [make_event(f"req-{i}") for i in range(200)]
    results: list[list[bool]] = []

    def insert_all() -> None:
        results.append(ledger.insert_many(events))

    threads = [threading.Thread(target=insert_all) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(sum(r) for r in results) == 200
    assert ledger.count() == 200


def test_a_reopened_sqlite_ledger_keeps_its_rows(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from billing.ledger import SqliteLedger, open_ledger

    path = tmp_path / "l.sqlite3"
    first = SqliteLedger(path)
    first.insert(make_event("req-1"))
    first.close()
    again = open_ledger(path)
    assert isinstance(again, SqliteLedger)
    assert again.insert(make_event("req-1")) is False
    assert again.count() == 1
    again.close()


def test_postgres_ledger_reconnects_after_its_connection_is_killed(postgres_url: str) -> None:
    import psycopg

    from billing.ledger import PostgresLedger

    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS usage_ledger")
    ledger = PostgresLedger(postgres_url)
    assert ledger.insert(make_event("req-1")) is True
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
    with pytest.raises(psycopg.OperationalError):
        ledger.insert(make_event("req-2"))  # the worker retries a failed batch
    assert ledger.insert(make_event("req-2")) is True
    assert ledger.count() == 2
    ledger.close()


def _open_together(url: str, count: int) -> tuple[list, list[BaseException]]:
    """`count` PostgresLedgers opened at once from as many threads: (opened, errors)."""
    from billing.ledger import PostgresLedger

    start = threading.Barrier(count)
    opened: list[PostgresLedger] = []
    errors: list[BaseException] = []

    def open_one() -> None:
        start.wait()
        try:
            opened.append(PostgresLedger(url))
        except Exception as error:
            errors.append(error)

    threads = [threading.Thread(target=open_one) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return opened, errors


def test_postgres_ledgers_opened_together_on_a_fresh_database(postgres_url: str) -> None:
    """Eight ledgers creating the schema at once (three gateways starting on a fresh
    database once failed here: CREATE ... IF NOT EXISTS races in PostgreSQL)."""
    import psycopg

    for _ in range(3):  # the race needs a fresh schema: drop it between rounds
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute("DROP TABLE IF EXISTS usage_ledger")
        opened, errors = _open_together(postgres_url, 8)
        assert [type(e).__name__ for e in errors] == []
        assert len(opened) == 8
        assert opened[0].insert(make_event("req-1")) is True
        assert opened[7].insert(make_event("req-1")) is False  # one table, shared
        for ledger in opened:
            ledger.close()


def test_a_new_sqlite_ledger_is_readable_by_its_owner_alone(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import stat

    from billing.ledger import SqliteLedger

    ledger = SqliteLedger(tmp_path / "ledger.sqlite3")
    ledger.insert(make_event("req-1"))
    for name in ("ledger.sqlite3", "ledger.sqlite3-wal"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600, name
    ledger.close()


def _start(request_id: str, **overrides: object) -> object:
    """A gateway's start: the prompt's counts, no output yet."""
    values: dict[str, object] = {"output_tokens": 0, "ended_at": DAY1, "status": "cancelled"}
    return make_event(request_id, kind="start", **(values | overrides))


def _node(request_id: str, **overrides: object) -> object:
    """A node's record: what it computed and sent, and how the request ended there."""
    values: dict[str, object] = {"model": "smollm2", "account_id": "acct-a", "ended_at": DAY1 + 9}
    return make_event(request_id, kind="node", **(values | overrides))


def test_an_end_closes_its_start_and_later_news_of_it_is_dropped(ledger: Ledger) -> None:
    assert ledger.insert_many([_start("req-1"), _start("req-2")]) == [True, True]  # type: ignore[list-item]
    assert ledger.open_requests() == {"req-1": (DAY1, None), "req-2": (DAY1, None)}
    end = make_event("req-1", output_tokens=7, status="cancelled")
    assert ledger.insert_many([_node("req-2"), end]) == [True, True]  # type: ignore[list-item]
    assert ledger.open_requests() == {"req-2": (DAY1, DAY1 + 9)}
    # The node's record and a replayed start after the end: nothing opens again.
    assert ledger.insert_many([_node("req-1"), _start("req-1")]) == [False, False]  # type: ignore[list-item]
    assert ledger.open_requests() == {"req-2": (DAY1, DAY1 + 9)}
    assert ledger.get("req-1") == end
    assert ledger.count() == 1


def test_a_start_without_its_end_is_billed_from_the_nodes_record_after_the_grace(
    ledger: Ledger,
) -> None:
    ledger.insert_many(
        [
            _start("req-1", input_tokens=40, cached_tokens=16),
            _node("req-1", input_tokens=40, output_tokens=12, status="cancelled"),
            _start("req-2", input_tokens=30),
            _node("req-3", output_tokens=5),  # no start: nothing reached a client
            _node("req-4", ended_at=DAY1 + 100, output_tokens=3),
            _start("req-4", input_tokens=8),
        ]  # type: ignore[list-item]
    )
    assert ledger.complete_orphans(DAY1 + 9) == []  # the node's record is not older yet
    completed = ledger.complete_orphans(DAY1 + 10)
    expected = make_event(
        "req-1", input_tokens=40, cached_tokens=16, output_tokens=12, ended_at=DAY1 + 9,
        status="cancelled",
    )  # fmt: skip
    assert completed == [expected]
    assert ledger.get("req-1") == expected
    # req-2 waits for its node's record, req-3 for its start, req-4 for the grace.
    assert ledger.open_requests() == {
        "req-2": (DAY1, None),
        "req-3": (None, DAY1 + 9),
        "req-4": (DAY1, DAY1 + 100),
    }
    assert ledger.complete_orphans(DAY1 + 101) == [
        make_event("req-4", input_tokens=8, output_tokens=3, ended_at=DAY1 + 100)
    ]
    assert ledger.count() == 2
    # The gateway's own end, late (journaled while Redis was away), says what reached the
    # client: it replaces the row billed without it, once, and a replay of it changes nothing.
    late = make_event("req-1", input_tokens=40, cached_tokens=16, output_tokens=11)
    assert ledger.insert(late) is True
    assert ledger.get("req-1") == late
    assert ledger.insert(make_event("req-1", output_tokens=99)) is False
    assert ledger.get("req-1") == late
    assert ledger.count() == 2


def test_open_requests_nothing_more_can_come_of_are_forgotten(ledger: Ledger) -> None:
    ledger.insert_many(
        [
            _start("req-1"), _node("req-1"),  # billed from the two at the grace
            _node("req-2"),  # no start: nothing reached a client
            _start("req-3"),  # its node died too: kept for reconcile to name
        ]  # type: ignore[list-item]
    )  # fmt: skip
    assert [e.request_id for e in ledger.complete_orphans(DAY1 + 10)] == ["req-1"]
    assert ledger.forget_open(DAY1 + 9) == 0  # req-2's record is not older than that
    assert ledger.forget_open(DAY1 + 10) == 1  # req-2; req-1 was completed just now
    assert ledger.open_requests() == {"req-3": (DAY1, None)}
    assert ledger.forget_open(time.time() + 1) == 1  # req-1's completion
    assert ledger.open_requests() == {"req-3": (DAY1, None)}
    # Forgotten: an end of req-1 now is a replay of what was billed.
    assert ledger.insert(make_event("req-1", output_tokens=11)) is False


def test_an_open_requests_table_of_the_first_form_gains_its_new_column(
    ledger: Ledger,
) -> None:
    """A table made with usage_open's first columns (no completed_at) works once opened."""
    import psycopg

    from billing.ledger import PostgresLedger, SqliteLedger

    first_form = (
        "CREATE TABLE usage_open (request_id TEXT PRIMARY KEY, start_event TEXT, "
        "node_event TEXT, started_at DOUBLE PRECISION, node_ended_at DOUBLE PRECISION, "
        "recorded_at DOUBLE PRECISION NOT NULL)"
    )
    ledger.close()
    if isinstance(ledger, SqliteLedger):
        with sqlite3.connect(ledger.path) as conn:
            conn.execute("DROP TABLE usage_open")
            conn.execute(first_form)
        reopened: Ledger = SqliteLedger(ledger.path)
    else:
        assert isinstance(ledger, PostgresLedger)
        with psycopg.connect(ledger._url, autocommit=True) as conn:
            conn.execute("DROP TABLE usage_open")
            conn.execute(first_form)
        reopened = PostgresLedger(ledger._url)
    reopened.insert_many([_start("req-1"), _node("req-1")])  # type: ignore[list-item]
    assert [e.request_id for e in reopened.complete_orphans(DAY1 + 10)] == ["req-1"]
    assert reopened.open_requests() == {}
    reopened.close()
