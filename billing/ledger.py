"""The ledger: one row per billed request, keyed by request id, so billing is exactly once.

Beside it, `usage_open` holds the requests a stream's `start` (or a node's record) has
announced and no `end` has closed yet (`billing/open_requests.py`): a stream whose
gateway died is billed from its start and its node's record (`complete_orphans`).

Two stores behind one interface: `SqliteLedger` (embedded, a file path; what
`edgeserve up` uses) and `PostgresLedger` (psycopg 3, a URL; for fleets). The
worker, reports and reconciliation only see `Ledger`.

The interface is synchronous on purpose: both drivers are blocking, so async
callers hop to a thread (`asyncio.to_thread`); each ledger serialises its one
connection with a lock, which is all a single worker or report handler needs.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any, Protocol

from billing.errors import InvalidUsageEvent
from billing.events import Status, UsageEvent
from billing.open_requests import ADDED_COLUMNS, OpenSql, completed, merge_params
from billing.open_requests import SCHEMA as OPEN_SCHEMA

# The UTC day is stored as 'YYYY-MM-DD' text in both stores: it compares in
# date order, groups without time-zone functions, and reads the same in SQL.
_SCHEMA_LOCK = 0x6564676573657276  # "edgeserv": the advisory lock around schema creation
_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage_ledger (
    request_id    TEXT PRIMARY KEY,
    account_id    TEXT NOT NULL,
    model         TEXT NOT NULL,
    node_id       TEXT NOT NULL,
    input_tokens  BIGINT NOT NULL,
    output_tokens BIGINT NOT NULL,
    cached_tokens BIGINT NOT NULL,
    started_at    DOUBLE PRECISION NOT NULL,
    ended_at      DOUBLE PRECISION NOT NULL,
    status        TEXT NOT NULL,
    usage_day     TEXT NOT NULL,
    recorded_at   DOUBLE PRECISION NOT NULL
)
"""
_INDEX = (
    "CREATE INDEX IF NOT EXISTS usage_ledger_day_account ON usage_ledger (usage_day, account_id)"
)
_COLUMNS = (
    "request_id, account_id, model, node_id, input_tokens, output_tokens, cached_tokens, "
    "started_at, ended_at, status"
)
# What is billed: requests that ended "ok" or "cancelled" (by the client, for what reached
# it). A request that failed on our side ("error": a node died, a handoff broke) keeps its
# ledger row, for reconciliation, and costs the account nothing.
BILLED_STATUSES = ("ok", "cancelled")
_DAILY = (
    "SELECT account_id, model, usage_day, COUNT(*), SUM(input_tokens), SUM(cached_tokens), "
    "SUM(output_tokens) FROM usage_ledger WHERE usage_day >= {p} AND usage_day <= {p} {account} "
    f"AND status IN {BILLED_STATUSES!r} "
    "GROUP BY account_id, model, usage_day ORDER BY usage_day, account_id, model"
)
# How many ids one membership query carries (SQLite's default limit is 32766 variables).
_ID_CHUNK = 500


def usage_day(event: UsageEvent) -> date:
    """The UTC day a request is billed on: the day it ended."""
    return datetime.fromtimestamp(event.ended_at, UTC).date()


@dataclass(frozen=True, slots=True)
class DailyUsage:
    """Ledger totals for one account x model x UTC day."""

    account_id: str
    model: str
    day: date
    requests: int
    input_tokens: int
    cached_tokens: int
    output_tokens: int


class Ledger(Protocol):
    """Where billed requests live. Every method is safe to call from any thread."""

    def insert(self, event: UsageEvent) -> bool:
        """Record one event; True if it was new, False if its request id was already billed."""
        ...

    def insert_many(self, events: Sequence[UsageEvent]) -> list[bool]:
        """Record a batch in one transaction (committed when this returns); per event, was it new."""
        ...

    def get(self, request_id: str) -> UsageEvent | None: ...

    def daily_usage(
        self, start: date, end: date, account_id: str | None = None
    ) -> list[DailyUsage]:
        """Billed totals (BILLED_STATUSES) per account x model x day for days start..end
        inclusive, in day, account, model order."""
        ...

    def missing(self, request_ids: Iterable[str]) -> set[str]:
        """Those of `request_ids` that have no ledger row."""
        ...

    def rows(self, request_ids: Iterable[str]) -> dict[str, UsageEvent | None]:
        """The ledger rows of those of `request_ids` that have one, by request id; None for a
        row that is no valid usage event (written by something other than the worker)."""
        ...

    def ended_since(self, when: float) -> list[str]:
        """Request ids of the rows whose request ended at or after `when` (epoch seconds)."""
        ...

    def count(self) -> int: ...

    def complete_orphans(self, node_ended_before: float) -> list[UsageEvent]:
        """Bill each open request that has a start and whose node's record says it ended
        before `node_ended_before`: its end never came (its gateway died), so the row is
        built from the two, status as the node ended it. Returns the rows written."""
        ...

    def forget_open(self, before: float) -> int:
        """Forget the open requests nothing more can come of: those billed from a start and
        a node record before `before` (a late end replaces their row until then), and node
        records without a start that ended before it (nothing reached a client). Returns
        how many."""
        ...

    def open_requests(self) -> dict[str, tuple[float | None, float | None]]:
        """Open requests not billed yet: request id -> (started_at of its start,
        node_ended_at of its node's record), None for the one not come yet."""
        ...

    def close(self) -> None: ...


class _SqlLedger:
    """The SQL both stores share; subclasses supply the connection and placeholder."""

    _placeholder: str

    def __init__(self) -> None:
        self._lock = threading.Lock()
        p = self._placeholder
        marks = ", ".join([p] * 12)
        self._insert_sql = (
            f"INSERT INTO usage_ledger ({_COLUMNS}, usage_day, recorded_at) VALUES ({marks}) "
            "ON CONFLICT (request_id) DO NOTHING"
        )
        self._open_sql = OpenSql.for_placeholder(p)

    # -- what a store provides --------------------------------------------------------
    def _execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        raise NotImplementedError

    def _transaction(self) -> Any:
        raise NotImplementedError

    def _existing(self, request_ids: list[str]) -> Iterable[tuple[str]]:
        raise NotImplementedError

    # -- the interface ----------------------------------------------------------------
    def insert(self, event: UsageEvent) -> bool:
        return self.insert_many([event])[0]

    def insert_many(self, events: Sequence[UsageEvent]) -> list[bool]:
        """Per event: an end, was its row new; a start or node record, is its request open."""
        if not events:
            return []
        now = time.time()
        ends = [e for e in events if e.kind == "end"]
        opens = [e for e in events if e.kind != "end"]
        with self._lock, self._transaction():
            # Announcements first: an end in the same batch then closes what they opened.
            is_open = [
                self._execute(self._open_sql.merge, merge_params(e, now)).rowcount == 1
                for e in opens
            ]
            for e in ends:
                self._execute(self._open_sql.replace_completed, (e.request_id, e.request_id))
            is_new = self._insert_rows([_row(e, now) for e in ends]) if ends else []
            for e in ends:
                self._execute(self._open_sql.close, (e.request_id,))
        ends_new, opens_kept = iter(is_new), iter(is_open)  # each in its events' order
        return [next(ends_new) if e.kind == "end" else next(opens_kept) for e in events]

    def complete_orphans(self, node_ended_before: float) -> list[UsageEvent]:
        now = time.time()
        with self._lock, self._transaction():
            due = self._execute(self._open_sql.due, (node_ended_before,)).fetchall()
            orphans = [completed(start, node) for _, start, node in due]
            if orphans:
                self._insert_rows([_row(e, now) for e in orphans])
            for request_id, _, _ in due:
                self._execute(self._open_sql.complete, (now, request_id))
        return orphans

    def forget_open(self, before: float) -> int:
        with self._lock, self._transaction():
            return int(self._execute(self._open_sql.forget, (before, before)).rowcount)

    def open_requests(self) -> dict[str, tuple[float | None, float | None]]:
        with self._lock:
            rows = self._execute(self._open_sql.listing).fetchall()
        return {rid: (started, ended) for rid, started, ended in rows}

    def _insert_rows(self, rows: list[tuple[Any, ...]]) -> list[bool]:
        """Inside the transaction: insert each row, was it new (a conflict inserts nothing)."""
        return [self._execute(self._insert_sql, row).rowcount == 1 for row in rows]

    def get(self, request_id: str) -> UsageEvent | None:
        found = self.rows([request_id])
        if request_id in found and found[request_id] is None:
            raise InvalidUsageEvent(f"the ledger row of {request_id} is no valid usage event")
        return found.get(request_id)

    def rows(self, request_ids: Iterable[str]) -> dict[str, UsageEvent | None]:
        wanted = list(dict.fromkeys(request_ids))
        found: dict[str, UsageEvent | None] = {}
        with self._lock:
            for i in range(0, len(wanted), _ID_CHUNK):
                chunk = wanted[i : i + _ID_CHUNK]
                marks = ", ".join([self._placeholder] * len(chunk))
                sql = f"SELECT {_COLUMNS} FROM usage_ledger WHERE request_id IN ({marks})"
                for row in self._execute(sql, chunk).fetchall():
                    try:
                        found[row[0]] = _event(row)
                    except InvalidUsageEvent:
                        found[row[0]] = None
        return found

    def ended_since(self, when: float) -> list[str]:
        p = self._placeholder
        with self._lock:
            rows = self._execute(
                f"SELECT request_id FROM usage_ledger WHERE ended_at >= {p} ORDER BY request_id",
                (when,),
            ).fetchall()
        return [rid for (rid,) in rows]

    def daily_usage(
        self, start: date, end: date, account_id: str | None = None
    ) -> list[DailyUsage]:
        p = self._placeholder
        params: list[Any] = [start.isoformat(), end.isoformat()]
        account = ""
        if account_id is not None:
            account = f"AND account_id = {p}"
            params.append(account_id)
        with self._lock:
            rows = self._execute(_DAILY.format(p=p, account=account), params).fetchall()
        return [
            DailyUsage(
                account_id=acct,
                model=model,
                day=date.fromisoformat(day),
                requests=int(n),
                input_tokens=int(num_in),
                cached_tokens=int(num_cached),
                output_tokens=int(num_out),
            )
            for acct, model, day, n, num_in, num_cached, num_out in rows
        ]

    def missing(self, request_ids: Iterable[str]) -> set[str]:
        wanted = list(dict.fromkeys(request_ids))
        found: set[str] = set()
        with self._lock:
            for i in range(0, len(wanted), _ID_CHUNK):
                found.update(rid for (rid,) in self._existing(wanted[i : i + _ID_CHUNK]))
        return set(wanted) - found

    def count(self) -> int:
        with self._lock:
            (n,) = self._execute("SELECT COUNT(*) FROM usage_ledger").fetchone()
        return int(n)


class SqliteLedger(_SqlLedger):
    """The embedded ledger: one SQLite file in WAL mode (a report can read while the worker writes)."""

    _placeholder = "?"

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        self.path = Path(path)
        if not self.path.exists():
            # Readable by its owner alone (who used what is private); SQLite gives its WAL
            # and shared-memory files the database's own mode.
            os.close(os.open(self.path, os.O_CREAT | os.O_WRONLY, 0o600))
        # isolation_level=None: we open transactions ourselves, so a commit is explicit.
        self._conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._conn.execute("PRAGMA journal_mode=WAL")
        # FULL: a committed row survives power loss, which is what lets the worker ack after commit.
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.execute("PRAGMA busy_timeout=5000")
        self._conn.execute(_SCHEMA)
        self._conn.execute(_INDEX)
        self._conn.execute(OPEN_SCHEMA)
        present = {row[1] for row in self._conn.execute("PRAGMA table_info(usage_open)")}
        for column, kind in ADDED_COLUMNS.items():
            if column not in present:
                self._conn.execute(f"ALTER TABLE usage_open ADD COLUMN {column} {kind}")

    def _execute(self, sql: str, params: Sequence[Any] = ()) -> sqlite3.Cursor:
        return self._conn.execute(sql, params)

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        # IMMEDIATE takes the write lock up front, so two writers queue instead of deadlocking.
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    def _existing(self, request_ids: list[str]) -> Iterable[tuple[str]]:
        marks = ", ".join("?" * len(request_ids))
        return self._conn.execute(
            f"SELECT request_id FROM usage_ledger WHERE request_id IN ({marks})", request_ids
        ).fetchall()

    def close(self) -> None:
        with self._lock:
            self._conn.close()


class PostgresLedger(_SqlLedger):
    """The fleet ledger on PostgreSQL (psycopg 3), given a connection URL."""

    _placeholder = "%s"

    def __init__(self, url: str) -> None:
        import psycopg

        super().__init__()
        self._url = url
        self._connect = psycopg.connect
        self._conn = self._open()

    def _open(self) -> Any:
        # autocommit: reads take no transaction; writes open one explicitly in insert_many.
        conn = self._connect(self._url, autocommit=True)
        with conn.transaction():
            # Processes starting together (three gateways on a fresh database) would race
            # in CREATE ... IF NOT EXISTS, which is not atomic in PostgreSQL: one wins, the
            # others fail on pg_type's unique index. The lock makes them take turns.
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
            conn.execute(_SCHEMA)
            conn.execute(_INDEX)
            conn.execute(OPEN_SCHEMA)
            for column, kind in ADDED_COLUMNS.items():
                conn.execute(f"ALTER TABLE usage_open ADD COLUMN IF NOT EXISTS {column} {kind}")
        return conn

    def _live(self) -> Any:
        # A server restart breaks the connection; the next call reconnects instead of failing forever.
        if self._conn.broken:
            self._conn = self._open()
        return self._conn

    def _execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        return self._live().execute(sql, params)

    def _transaction(self) -> Any:
        return self._live().transaction()

    def _existing(self, request_ids: list[str]) -> Iterable[tuple[str]]:
        return self._execute(
            "SELECT request_id FROM usage_ledger WHERE request_id = ANY(%s)", (request_ids,)
        ).fetchall()

    def _insert_rows(self, rows: list[tuple[Any, ...]]) -> list[bool]:
        # executemany pipelines the batch: one round trip instead of one per row. RETURNING
        # yields a row only for an insert, so each statement's result says if it was new.
        cursor = self._conn.cursor()
        cursor.executemany(self._insert_sql + " RETURNING 1", rows, returning=True)
        is_new = []
        while True:
            is_new.append(cursor.fetchone() is not None)
            if not cursor.nextset():
                return is_new

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def is_database_url(location: str | Path) -> bool:
    """Whether `location` names a PostgreSQL database (postgres:// or postgresql://), not a
    SQLite file."""
    return str(location).startswith(("postgres://", "postgresql://"))


def open_ledger(location: str | Path) -> Ledger:
    """A PostgresLedger for a postgres:// or postgresql:// URL, else a SqliteLedger at that path."""
    if is_database_url(location):
        return PostgresLedger(str(location))
    return SqliteLedger(location)


def default_sqlite_path() -> Path:
    """Where the embedded ledger lives when no location is given: `$EDGESERVE_HOME`, which
    holds everything a machine's edgeserve keeps, else the per-user data dir (not the cache
    dir the models go to: a ledger is not a cache)."""
    configured = os.environ.get("EDGESERVE_HOME")
    if configured:
        return Path(configured).expanduser() / "ledger.sqlite3"
    import platformdirs

    return platformdirs.user_data_path("edgeserve") / "ledger.sqlite3"


def _event(row: Sequence[Any]) -> UsageEvent:
    """A ledger row (its _COLUMNS) as the event it records."""
    rid, account, model, node, num_in, num_out, num_cached, started, ended, status = row
    status_value: Status = status
    return UsageEvent(
        request_id=rid,
        account_id=account,
        model=model,
        node_id=node,
        input_tokens=int(num_in),
        output_tokens=int(num_out),
        cached_tokens=int(num_cached),
        started_at=float(started),
        ended_at=float(ended),
        status=status_value,
    )


def _row(e: UsageEvent, recorded_at: float) -> tuple[Any, ...]:
    """An end event as its usage_ledger row."""
    return (
        e.request_id,
        e.account_id,
        e.model,
        e.node_id,
        e.input_tokens,
        e.output_tokens,
        e.cached_tokens,
        e.started_at,
        e.ended_at,
        e.status,
        usage_day(e).isoformat(),
        recorded_at,
    )
