"""`edgeserve keys create | list | revoke`: API keys, stored hashed in Redis."""

from __future__ import annotations

from typing import Any

import typer

from edgeserve.settings import DEFAULT_REDIS_URL
from edgeserve.stores import run_on_redis

keys_app = typer.Typer(
    no_args_is_help=True,
    help="API keys (stored hashed in the fleet's Redis). A plain `edgeserve up` keeps its one "
    "key in its own process and never reads these: start it with --redis-url to use them.",
)


def register(app: typer.Typer) -> None:
    app.add_typer(keys_app, name="keys")


def _keys_store(client: Any, prefix: str) -> Any:
    from gateway.keys import RedisKeyStore

    return RedisKeyStore(client, prefix)


@keys_app.command("create")
def keys_create(
    account: str = typer.Option(..., help="the account the key acts for"),
    redis_url: str = typer.Option(DEFAULT_REDIS_URL, envvar="REDIS_URL"),
    prefix: str = typer.Option("edgeserve:"),
) -> None:
    """Create a key and print it (once: only its hash is stored)."""
    from gateway.keys import InvalidAccountIdError, key_id_of

    try:
        key = run_on_redis(redis_url, lambda client: _keys_store(client, prefix).create(account))
    except InvalidAccountIdError as exc:
        raise typer.BadParameter(str(exc)) from None
    typer.echo(key)
    typer.echo(
        f"key id {key_id_of(key)} for account {account}; this key is not shown again", err=True
    )


@keys_app.command("list")
def keys_list(
    account: str = typer.Option(...),
    redis_url: str = typer.Option(DEFAULT_REDIS_URL, envvar="REDIS_URL"),
    prefix: str = typer.Option("edgeserve:"),
) -> None:
    """The account's key ids (never the keys)."""
    infos = run_on_redis(redis_url, lambda client: _keys_store(client, prefix).list(account))
    for info in infos:
        typer.echo(f"{info.key_id}\t{info.account_id}\t{info.created_at:.0f}")


@keys_app.command("revoke")
def keys_revoke(
    key_id: str,
    redis_url: str = typer.Option(DEFAULT_REDIS_URL, envvar="REDIS_URL"),
    prefix: str = typer.Option("edgeserve:"),
) -> None:
    """Revoke a key by its id; every gateway stops accepting it within a second."""
    if not run_on_redis(redis_url, lambda client: _keys_store(client, prefix).revoke(key_id)):
        typer.echo(f"no key with id {key_id}", err=True)
        raise typer.Exit(1)
    typer.echo(f"revoked {key_id}")
