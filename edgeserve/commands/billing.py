"""`edgeserve billing worker|report|reconcile`: the usage stream, the ledger and its reports."""

from __future__ import annotations

import os
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

import typer

from edgeserve.settings import DEFAULT_REDIS_URL, redis_client
from edgeserve.stores import (
    DATABASE_URL_ALIAS,
    LEDGER,
    SQLITE_ALIAS,
    command_ledger,
    ledger_errors,
    ledger_failed,
    ledger_flag,
    ledger_location,
    run_on_redis,
)

# A test seam: when set to a file path, the worker writes the entry ids of each
# committed batch there and then stalls before acknowledging them, so a test can
# SIGKILL it between its ledger commit and its XACK.
PAUSE_AFTER_COMMIT_ENV = "EDGESERVE_BILLING_PAUSE_AFTER_COMMIT"

_REDIS = typer.Option(DEFAULT_REDIS_URL, "--redis-url", envvar="REDIS_URL", help="Redis URL")
_STREAM = typer.Option("edgeserve:usage", "--stream", help="usage stream key")
_GROUP = typer.Option("billing", "--group", help="consumer group")


def _day(text: str | None, default: date, name: str) -> date:
    from billing.errors import InvalidReportQuery
    from billing.reports import parse_day

    if text is None:
        return default
    try:
        return parse_day(text, name)
    except InvalidReportQuery as exc:
        raise typer.BadParameter(str(exc), param_hint=f"--{name}") from None


def register(app: typer.Typer) -> None:
    billing_app = typer.Typer(
        no_args_is_help=True, help="Usage billing: worker, reports, reconcile."
    )

    @billing_app.command("worker")
    def worker(
        redis_url: str = _REDIS,
        ledger: str | None = LEDGER,
        database_url: str | None = DATABASE_URL_ALIAS,
        sqlite: Path | None = SQLITE_ALIAS,
        stream: str = _STREAM,
        group: str = _GROUP,
        consumer: str = typer.Option("", help="consumer name (default: hostname-pid)"),
        batch_size: int = typer.Option(100, min=1),
        claim_idle_ms: int = typer.Option(30_000, min=1, help="claim entries idle this long"),
        claim_interval_s: float = typer.Option(5.0, min=0.001),
        retain_days: float = typer.Option(
            7.0, min=0, help="trim acknowledged entries older than this (0: keep all)"
        ),
        dead_letter_max: int = typer.Option(
            100_000, min=0, help="dead letters kept, the newest (0: keep all)"
        ),
        orphan_grace_s: float = typer.Option(
            300.0,
            min=0,
            help="a stream whose gateway died mid-answer is billed from its node's record "
            "this long after the node ended it",
        ),
    ) -> None:
        """Move usage events from the Redis stream into the ledger, exactly once, until SIGTERM."""
        import asyncio
        import signal

        from billing.worker import BillingWorker, WorkerConfig

        config = WorkerConfig(
            stream_key=stream,
            group=group,
            consumer=consumer,
            batch_size=batch_size,
            claim_idle_ms=claim_idle_ms,
            claim_interval_s=claim_interval_s,
            retain_s=retain_days * 86_400,
            dead_letter_max=dead_letter_max,
            orphan_grace_s=orphan_grace_s,
        )
        ledger_db = command_ledger(ledger_flag(ledger, database_url, sqlite), create=True)

        async def main() -> None:
            client = redis_client(redis_url)
            pause_path = os.environ.get(PAUSE_AFTER_COMMIT_ENV)
            hook = _pause_after_commit(Path(pause_path)) if pause_path else None
            billing_worker = BillingWorker(client, ledger_db, config, after_commit=hook)
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, billing_worker.stop)
            typer.echo(f"billing worker {billing_worker.consumer} on {stream} ({group})", err=True)
            try:
                await billing_worker.run()
            finally:
                await client.aclose()
            typer.echo(
                f"stopped: {billing_worker.num_new} new, {billing_worker.num_duplicate} duplicate, "
                f"{billing_worker.num_dead} dead-lettered",
                err=True,
            )

        try:
            asyncio.run(main())
        finally:
            ledger_db.close()

    @billing_app.command("report")
    def report(
        account: str | None = typer.Option(None, help="one account (default: all)"),
        from_: str | None = typer.Option(None, "--from", help="first UTC day, YYYY-MM-DD"),
        to: str | None = typer.Option(None, "--to", help="last UTC day (default: today)"),
        group_by: str = typer.Option("account,model,day", help="any of account,model,day"),
        format: str = typer.Option("table", "--format", help="table | json | csv"),
        prices: Path | None = typer.Option(None, help="price TOML (default: the shipped one)"),
        ledger: str | None = LEDGER,
        database_url: str | None = DATABASE_URL_ALIAS,
        sqlite: Path | None = SQLITE_ALIAS,
    ) -> None:
        """Usage and cost per account x model x UTC day (default: the last 30 days)."""
        import json

        from rich.console import Console

        from billing.errors import BillingError, InvalidReportQuery
        from billing.prices import PriceTable
        from billing.reports import (
            build_report,
            parse_group_by,
            to_csv,
            to_json,
            to_table,
            window_start,
        )

        if format not in ("table", "json", "csv"):
            raise typer.BadParameter("use table, json or csv", param_hint="--format")
        end = _day(to, datetime.now(UTC).date(), "to")
        if from_ is not None:
            start = _day(from_, end, "from")
        else:
            try:
                start = window_start(end)
            except InvalidReportQuery as exc:
                raise typer.BadParameter(str(exc), param_hint="--to") from None
        location = ledger_flag(ledger, database_url, sqlite)
        try:
            table = PriceTable.load(prices) if prices else PriceTable.default()
            keys = parse_group_by(group_by)
            ledger_db = command_ledger(location, create=False)
            try:
                result = build_report(
                    ledger_db, table, start, end, account_id=account, group_by=keys
                )
            finally:
                ledger_db.close()
        except BillingError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        except ledger_errors() as exc:
            raise ledger_failed(ledger_location(location), exc) from None
        if format == "json":
            typer.echo(json.dumps(to_json(result), indent=2))
        elif format == "csv":
            typer.echo(to_csv(result), nl=False)
        else:
            console, rendered = Console(), to_table(result)
            if not console.is_terminal:  # piped: as wide as the table is, not 80 columns
                console = Console(width=Console(width=10_000).measure(rendered).maximum)
            console.print(rendered)

    @billing_app.command("reconcile")
    def reconcile_command(
        redis_url: str = _REDIS,
        ledger: str | None = LEDGER,
        database_url: str | None = DATABASE_URL_ALIAS,
        sqlite: Path | None = SQLITE_ALIAS,
        stream: str = _STREAM,
        group: str = _GROUP,
        journal: list[Path] = typer.Option([], help="gateway journal file(s) to include"),
        as_json: bool = typer.Option(False, "--json", help="print the report as JSON"),
    ) -> None:
        """Compare the ledger with the stream and journals; exit 1 if an acknowledged event has
        no row, or a recent row has no event or differs from its event."""
        import json

        from billing.reconcile import reconcile

        ledger_db = command_ledger(ledger_flag(ledger, database_url, sqlite), create=False)

        async def checked(client: Any) -> Any:
            # The gateways and the worker create the stream: none means a mistyped --stream
            # (or another Redis), and would have read as a clean reconcile.
            if not await client.exists(stream):
                return None
            return await reconcile(client, ledger_db, stream, group, journal)

        try:
            result = run_on_redis(redis_url, checked)
        finally:
            ledger_db.close()
        if result is None:
            typer.echo(
                f"error: no usage stream {stream!r} in that Redis (--stream names the one the "
                "gateways write)",
                err=True,
            )
            raise typer.Exit(2)
        if as_json:
            typer.echo(json.dumps(result.to_json(), indent=2))
        else:
            typer.echo(
                f"stream: {result.num_stream_entries} entries, {result.num_stream_requests} requests, "
                f"{result.num_pending_entries} pending, {result.num_unread_entries} unread, "
                f"{result.num_malformed_entries} malformed\n"
                f"journal: {result.num_journal_events} events, "
                f"{len(result.journal_unbilled)} not yet billed\n"
                f"in flight (no row yet): {len(result.in_flight)}\n"
                f"streams started, not yet billed: {len(result.open_starts)}\n"
                f"GAPS (acknowledged, no ledger row): {len(result.missing_from_ledger)}"
            )
            for request_id in result.missing_from_ledger:
                typer.echo(f"  {request_id}")
            for label, ids in (
                ("UNBACKED (recent row, no event)", result.unbacked_rows),
                ("DIFFERING (row unlike its event)", result.differing_rows),
                ("UNBILLED STARTS (no end, no node record)", result.unbilled_starts),
            ):
                typer.echo(f"{label}: {len(ids)}")
                for request_id in ids:
                    typer.echo(f"  {request_id}")
        if not result.is_consistent:
            raise typer.Exit(1)

    app.add_typer(billing_app, name="billing")


def _pause_after_commit(marker: Path) -> Any:
    import asyncio

    async def hook(entry_ids: list[str]) -> None:
        marker.write_text("\n".join(entry_ids) + "\n")
        await asyncio.Event().wait()  # stall here until killed

    return hook
