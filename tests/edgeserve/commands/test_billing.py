"""`edgeserve billing report|reconcile|worker` through the real typer app (the ledger
fixture: tests/edgeserve/conftest.py)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import redis
from typer.testing import CliRunner

from billing.ledger import SqliteLedger
from edgeserve.cli import build_app
from tests.billing.samples import make_event
from tests.conftest import REDIS_URL

SMOL = "@cf/huggingface/smollm2-135m-instruct"


def test_report_csv_for_one_account(ledger_file: Path) -> None:
    path = ledger_file
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


def test_report_json_grouped_by_account(ledger_file: Path) -> None:
    path = ledger_file
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


def test_report_rejects_bad_input_with_a_clear_message(ledger_file: Path) -> None:
    path = ledger_file
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
    ledger_file: Path, redis_prefix: str
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
    path = ledger_file
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


def test_the_report_table_piped_keeps_every_cell_whole(ledger_file: Path) -> None:
    """Piped, rich had laid the table out in 80 columns and cut the model, day and cost."""
    path = ledger_file
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
