"""`edgeserve billing report|reconcile` through the real typer app."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import psycopg
import redis
from typer.testing import CliRunner

from billing.ledger import PostgresLedger, SqliteLedger
from edgeserve.cli import build_app
from tests.billing.samples import DAY2, make_event
from tests.conftest import REDIS_URL, free_port

SMOL = "@cf/huggingface/smollm2-135m-instruct"


def ledger_file(tmp_path: Path) -> Path:
    path = tmp_path / "ledger.sqlite3"
    ledger = SqliteLedger(path)
    ledger.insert_many(
        [
            make_event("a-1", input_tokens=1_000_000, cached_tokens=500_000, output_tokens=0),
            make_event("a-2", started_at=DAY2, ended_at=DAY2, output_tokens=1_000_000),
            make_event("b-1", account_id="acct-b"),
        ]
    )
    ledger.close()
    return path


def test_report_csv_for_one_account(tmp_path: Path) -> None:
    path = ledger_file(tmp_path)
    result = CliRunner().invoke(
        build_app(),
        ["billing", "report", "--sqlite", str(path), "--account", "acct-a",
         "--from", "2026-11-02", "--to", "2026-11-03", "--format", "csv"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    # day 1: 500k * 0.027 + 500k cached * 0.0135 per million; day 2: 100 in, 1M out * 0.201
    assert result.output == (
        "account_id,model,day,requests,input_tokens,cached_tokens,output_tokens,cost,currency\n"
        f"acct-a,{SMOL},2026-11-02,1,1000000,500000,0,0.02025,USD\n"
        f"acct-a,{SMOL},2026-11-03,1,100,0,1000000,0.2010027,USD\n"
    )


def test_report_json_grouped_by_account(tmp_path: Path) -> None:
    path = ledger_file(tmp_path)
    result = CliRunner().invoke(
        build_app(),
        ["billing", "report", "--sqlite", str(path), "--from", "2026-11-02",
         "--to", "2026-11-03", "--format", "json", "--group-by", "account"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    body = json.loads(result.output)
    assert [(r["account_id"], r["requests"], r["cost"]) for r in body["rows"]] == [
        ("acct-a", 2, "0.2212527"),
        ("acct-b", 1, "0.00000672"),  # 100 * 0.027 + 20 * 0.201 per million
    ]


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


def test_report_rejects_bad_input_with_a_clear_message(tmp_path: Path) -> None:
    path = ledger_file(tmp_path)
    app = build_app()
    bad_day = CliRunner().invoke(app, ["billing", "report", "--sqlite", str(path), "--from", "x"])
    assert bad_day.exit_code == 2
    assert "'x' is not a date (YYYY-MM-DD)" in bad_day.output
    bad_format = CliRunner().invoke(
        app, ["billing", "report", "--sqlite", str(path), "--format", "xml"]
    )
    assert bad_format.exit_code == 2
    assert "use table, json or csv" in bad_format.output
    too_early = CliRunner().invoke(
        app, ["billing", "report", "--sqlite", str(path), "--to", "0001-01-10"]
    )
    assert too_early.exit_code == 2
    message = " ".join(too_early.output.replace("│", " ").split())  # rich wraps it in a box
    assert "a 30-day window ending on 0001-01-10 starts before 0001-01-01" in message


def test_reconcile_exits_1_on_a_gap_and_0_when_consistent(
    tmp_path: Path, redis_prefix: str
) -> None:
    stream = redis_prefix + "usage"
    client = redis.Redis.from_url(REDIS_URL)
    client.xgroup_create(stream, "billing", id="0", mkstream=True)
    a1 = make_event("a-1", input_tokens=1_000_000, cached_tokens=500_000, output_tokens=0)
    client.xadd(stream, a1.to_fields())  # as ledger_file has it
    client.xadd(stream, make_event("z-9").to_fields())
    # Deliver and acknowledge both, though only a-1 has a ledger row: z-9 is a gap.
    entries = client.xreadgroup("billing", "w", {stream: ">"})[0][1]
    client.xack(stream, "billing", *[entry_id for entry_id, _ in entries])
    path = ledger_file(tmp_path)
    args = ["billing", "reconcile", "--redis-url", REDIS_URL, "--sqlite", str(path),
            "--stream", stream]  # fmt: skip
    gap = CliRunner().invoke(build_app(), [*args, "--json"])
    assert gap.exit_code == 1, gap.output
    assert json.loads(gap.output)["missing_from_ledger"] == ["z-9"]
    SqliteLedger(path).insert(make_event("z-9"))
    fixed = CliRunner().invoke(build_app(), args)
    assert fixed.exit_code == 0, fixed.output
    assert "GAPS (acknowledged, no ledger row): 0" in fixed.output
    # A row that says other than its event is as wrong as a missing one.
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE usage_ledger SET input_tokens = 999999 WHERE request_id = 'a-1'")
    differs = CliRunner().invoke(build_app(), args)
    assert differs.exit_code == 1, differs.output
    assert "DIFFERING (row unlike its event): 1\n  a-1\n" in differs.output
    # A mistyped stream had read as a clean reconcile (exit 0), the ledger's rows unchecked.
    typo = CliRunner().invoke(build_app(), [*args[:-1], stream + "s"])
    assert (typo.exit_code, typo.stderr) == (
        2,
        f"error: no usage stream {stream + 's'!r} in that Redis (--stream names the one the "
        "gateways write)\n",
    )
    client.close()


def test_the_worker_command_bills_then_stops_gracefully_on_sigterm(
    tmp_path: Path, redis_prefix: str
) -> None:
    import signal
    import subprocess
    import sys
    import time

    stream = redis_prefix + "usage"
    client = redis.Redis.from_url(REDIS_URL)
    for i in range(3):
        client.xadd(stream, make_event(f"req-{i}").to_fields())
    path = tmp_path / "ledger.sqlite3"
    worker = subprocess.Popen(
        [sys.executable, "-c", "from edgeserve.cli import main; main()", "billing", "worker",
         "--redis-url", REDIS_URL, "--sqlite", str(path), "--stream", stream, "--consumer", "w"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        ledger = None
        deadline = time.monotonic() + 20
        while ledger is None or ledger.count() < 3:
            assert time.monotonic() < deadline and worker.poll() is None
            time.sleep(0.05)
            if ledger is None and path.exists():
                ledger = SqliteLedger(path)
        worker.send_signal(signal.SIGTERM)
        _, stderr = worker.communicate(timeout=10)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert worker.returncode == 0
    assert stderr.splitlines()[-1] == "stopped: 3 new, 0 duplicate, 0 dead-lettered"
    assert client.xpending(stream, "billing")["pending"] == 0
    ledger.close()
    client.close()


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


def test_the_report_table_piped_keeps_every_cell_whole(tmp_path: Path) -> None:
    """Piped, rich had laid the table out in 80 columns and cut the model, day and cost."""
    path = ledger_file(tmp_path)
    result = CliRunner().invoke(
        build_app(),
        ["billing", "report", "--sqlite", str(path), "--from", "2026-11-02", "--to", "2026-11-03"],
        env={"COLUMNS": "80"},
    )
    assert result.exit_code == 0, result.output
    rows = [line for line in result.stdout.splitlines() if "acct-a" in line]
    assert [[cell.strip() for cell in row.split("│")[1:-1]] for row in rows] == [
        ["acct-a", SMOL, "2026-11-02", "1", "1000000", "500000", "0", "0.02025"],
        ["acct-a", SMOL, "2026-11-03", "1", "100", "0", "1000000", "0.2010027"],
    ]
    assert "…" not in result.stdout


def test_reconcile_and_keys_say_in_one_line_that_redis_is_unreachable(tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    app = build_app()
    reconcile = CliRunner().invoke(
        app, ["billing", "reconcile", "--sqlite", str(ledger_file(tmp_path)), "--redis-url", url]
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
