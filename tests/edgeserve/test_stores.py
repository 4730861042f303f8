"""How the commands reach Redis and the ledger (edgeserve/stores.py): the ledger from
DATABASE_URL, a ledger missing or unreadable and Redis unreachable each one line and an exit
code, and no password ever printed."""

from __future__ import annotations

import json
from pathlib import Path

import psycopg
from typer.testing import CliRunner

from billing.ledger import PostgresLedger
from edgeserve.cli import build_app
from tests.billing.samples import make_event
from tests.conftest import free_port


def test_the_ledger_comes_from_database_url_as_the_gateways_does(postgres_url: str) -> None:
    """The fleet's files set DATABASE_URL for every process; the billing commands read it
    (they had taken only --database-url, so the compose worker billed into a SQLite file)."""
    with psycopg.connect(postgres_url, autocommit=True) as conn:  # this test's rows alone
        conn.execute("DROP TABLE IF EXISTS usage_ledger, usage_open")
    ledger = PostgresLedger(postgres_url)
    ledger.insert_many([make_event("p-1"), make_event("p-2", account_id="acct-b")])
    ledger.close()
    result = CliRunner().invoke(
        build_app(),
        ["billing", "report", "--from", "2026-11-02", "--to", "2026-11-02", "--format", "json",
         "--group-by", "account"],
        env={"DATABASE_URL": postgres_url},
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)["rows"]
    assert [(r["account_id"], r["requests"]) for r in rows] == [("acct-a", 1), ("acct-b", 1)]


def test_report_on_a_ledger_that_is_not_there_says_so_and_creates_nothing(tmp_path: Path) -> None:
    """A mistyped path had been created, empty, and reported as zero usage."""
    missing = tmp_path / "typo" / "ledger.sqlite3"
    result = CliRunner().invoke(build_app(), ["billing", "report", "--sqlite", str(missing)])
    assert result.exit_code == 2
    assert result.stderr == (
        f"error: no ledger at {missing}: nothing was billed there (--ledger FILE|URL "
        "names another)\n"
    )
    assert not missing.parent.exists()


def test_a_ledger_that_cannot_be_read_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    not_a_database = tmp_path / "notes.txt"
    not_a_database.write_text("x" * 4096)
    app = build_app()
    result = CliRunner().invoke(app, ["billing", "report", "--sqlite", str(not_a_database)])
    assert (result.exit_code, result.stderr) == (
        2,
        f"error: the ledger at {not_a_database} cannot be read: file is not a database\n",
    )
    url = f"postgresql://auditor:s3cret@127.0.0.1:{free_port()}/ledger"
    result = CliRunner().invoke(app, ["billing", "report", "--database-url", url])
    assert result.exit_code == 2
    [line] = result.stderr.splitlines()
    assert line.startswith(
        f"error: the ledger at postgresql://auditor@127.0.0.1:{url.rsplit(':', 1)[1]} cannot "
        "be read: "
    )
    assert "s3cret" not in result.output


def test_reconcile_and_keys_say_in_one_line_that_redis_is_unreachable(ledger_file: Path) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    app = build_app()
    reconcile = CliRunner().invoke(
        app, ["billing", "reconcile", "--sqlite", str(ledger_file), "--redis-url", url]
    )
    create = CliRunner().invoke(app, ["keys", "create", "--account", "acme", "--redis-url", url])
    listed = CliRunner().invoke(app, ["keys", "list", "--account", "acme", "--redis-url", url])
    revoke = CliRunner().invoke(app, ["keys", "revoke", "k1", "--redis-url", url])
    for result in (reconcile, create, listed, revoke):
        assert result.exit_code == 1
        [line] = result.stderr.splitlines()
        assert line.startswith(f"error: cannot reach Redis at {url}: Error 111 connecting to ")
        assert result.stdout == ""


def test_a_redis_password_is_never_printed() -> None:
    url = f"redis://:s3cretpw@127.0.0.1:{free_port()}/0"
    result = CliRunner().invoke(build_app(), ["keys", "list", "--account", "x", "--redis-url", url])
    assert result.exit_code == 1
    assert result.stderr.startswith(
        f"error: cannot reach Redis at redis://@127.0.0.1:{url.rsplit(':', 1)[1]}: "
    )
    assert "s3cretpw" not in result.output


def test_a_ledger_is_named_in_messages_without_its_password(monkeypatch, tmp_path: Path) -> None:
    """The report's message for a read that failed had printed --database-url as given,
    password and all, and "the default file" for a URL taken from DATABASE_URL."""
    from billing.ledger import default_sqlite_path
    from edgeserve.stores import ledger_location

    url = "postgresql://auditor:s3cret@db.internal:5432/ledger"
    assert ledger_location(url, None) == "postgresql://auditor@db.internal:5432/ledger"
    monkeypatch.setenv("DATABASE_URL", url)
    assert ledger_location(None, None) == "postgresql://auditor@db.internal:5432/ledger"
    assert ledger_location(None, tmp_path / "l.sqlite3") == str(tmp_path / "l.sqlite3")
    monkeypatch.delenv("DATABASE_URL")
    assert ledger_location(None, None) == str(default_sqlite_path())
