"""How a command reaches the shared stores (Redis, the ledger): opened for that command
alone, and a store that cannot be reached or opened is one line on stderr and a non-zero
exit, never a traceback."""

from __future__ import annotations

import asyncio
import os
import sqlite3
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import typer

from edgeserve.settings import redis_client

if TYPE_CHECKING:
    from billing.ledger import Ledger

T = TypeVar("T")

UNREACHABLE_EXIT = 1  # the store did not answer; what the command was asked is not done
LEDGER_EXIT = 2


def run_on_redis(redis_url: str, action: Callable[[Any], Awaitable[T]]) -> T:
    """`action(client)` on an asyncio Redis client of its own, closed afterwards."""
    from redis.exceptions import RedisError

    async def main() -> T:
        client = redis_client(redis_url)
        try:
            return await action(client)
        finally:
            await client.aclose()

    try:
        return asyncio.run(main())
    except (RedisError, OSError) as exc:
        typer.echo(f"error: cannot reach Redis at {redacted(redis_url)}: {exc}", err=True)
        raise typer.Exit(UNREACHABLE_EXIT) from None


LEDGER_HELP = (
    "the ledger: a SQLite file or a postgresql:// URL (default: DATABASE_URL, else "
    "ledger.sqlite3 in EDGESERVE_HOME, else in the per-user data dir)"
)
# One flag names the ledger on every command; the older spellings stay as hidden aliases.
LEDGER = typer.Option(None, "--ledger", metavar="FILE|URL", help=LEDGER_HELP)
DATABASE_URL_ALIAS = typer.Option(None, "--database-url", hidden=True)
SQLITE_ALIAS = typer.Option(None, "--sqlite", hidden=True)


def ledger_flag(
    ledger: str | None, database_url: str | None, sqlite: Path | None
) -> str | Path | None:
    """What `--ledger` names, or one of its hidden aliases; None when none is given."""
    given = [name for name, value in (("--ledger", ledger), ("--database-url", database_url),
                                      ("--sqlite", sqlite)) if value]  # fmt: skip
    if len(given) > 1:
        raise typer.BadParameter(f"give one of {', '.join(given)}, not several")
    return ledger or database_url or sqlite


def _location(ledger: str | Path | None, sqlite: Path | None = None) -> str | Path:
    """The ledger a command names: the flag (`ledger_flag`; `sqlite` is its SQLite form),
    else the environment's DATABASE_URL (as every command reads it, so a fleet's worker and
    gateways share one ledger from one setting), else `default_sqlite_path()`, the one a
    plain `up` bills into. A str is a PostgreSQL database in any form libpq takes (a URL or
    key=value pairs), a Path a SQLite file."""
    from billing.ledger import default_sqlite_path, is_database_url

    if isinstance(ledger, str) and not is_database_url(ledger) and "=" not in ledger:
        ledger = Path(ledger).expanduser()
    return ledger or sqlite or os.environ.get("DATABASE_URL") or default_sqlite_path()


def ledger_location(ledger: str | Path | None, sqlite: Path | None = None) -> str:
    """Where the ledger a command names lies, for its messages: never the password."""
    return redacted(str(_location(ledger, sqlite)))


def command_ledger(
    ledger: str | Path | None, sqlite: Path | None = None, *, create: bool
) -> Ledger:
    """The ledger a command names (`_location`). `create=False` (reports, reconciliation)
    refuses a SQLite file that does not exist: a mistyped path would otherwise read as an
    empty ledger and report zero usage."""
    from billing.ledger import PostgresLedger, SqliteLedger

    location = _location(ledger, sqlite)
    if isinstance(location, Path):
        if not create and not location.is_file():
            typer.echo(
                f"error: no ledger at {location}: nothing was billed there (--ledger FILE|URL "
                "names another)",
                err=True,
            )
            raise typer.Exit(LEDGER_EXIT)
        location.parent.mkdir(parents=True, exist_ok=True)
    try:
        return PostgresLedger(location) if isinstance(location, str) else SqliteLedger(location)
    except ledger_errors() as exc:
        raise ledger_failed(redacted(str(location)), exc) from None


def ledger_errors() -> tuple[type[BaseException], ...]:
    """What a ledger raises when its database cannot be opened or read."""
    import psycopg

    return (sqlite3.Error, psycopg.Error, OSError)


def ledger_failed(where: str, exc: BaseException) -> typer.Exit:
    message = " ".join(str(exc).split())  # a driver's message can run over several lines
    typer.echo(f"error: the ledger at {where} cannot be read: {message}", err=True)
    return typer.Exit(LEDGER_EXIT)


def redacted(url: str) -> str:
    """A Redis or database URL without its password, for an error message."""
    if "://" not in url or "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    credentials, host = rest.rsplit("@", 1)
    return f"{scheme}://{credentials.split(':', 1)[0]}@{host}"
