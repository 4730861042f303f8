"""`edgeserve limits set|show`: per-account (and per-model) rate limits in the fleet's Redis."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import typer

from edgeserve.settings import DEFAULT_REDIS_URL
from edgeserve.stores import run_on_redis

_ACCOUNT = typer.Option(..., "--account", help="account id")
_MODEL = typer.Option(None, "--model", help="limit this model only (default: the whole account)")
_REDIS = typer.Option(DEFAULT_REDIS_URL, "--redis-url", envvar="REDIS_URL", help="Redis URL")
_PREFIX = typer.Option("edgeserve", "--prefix", help="key prefix the gateways use")


def _run(redis_url: str, prefix: str, action: Callable[[Any], Awaitable[dict[str, Any]]]) -> None:
    """Runs `action(store)` against Redis, printing its result as JSON; errors exit non-zero."""
    from gateway.admission import AdmissionError, RedisLimitStore

    try:
        # "edgeserve" and "edgeserve:" name the same keys, as for the gateway and node
        result = run_on_redis(
            redis_url, lambda client: action(RedisLimitStore(client, prefix.rstrip(":")))
        )
    except AdmissionError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(json.dumps(result, indent=2))


def register(app: typer.Typer) -> None:
    limits_app = typer.Typer(
        no_args_is_help=True,
        help="Per-account rate limits in the fleet's Redis. A plain `edgeserve up` keeps its "
        "limits in its own process and never reads these: use its admin API "
        "(PUT /admin/v1/accounts/{id}/limits), or start it with --redis-url.",
    )

    @limits_app.command("set")
    def set_limits(
        account: str = _ACCOUNT,
        model: str | None = _MODEL,
        rpm: int | None = typer.Option(None, "--rpm", min=1, help="requests per minute"),
        tpm: int | None = typer.Option(None, "--tpm", min=1, help="tokens per minute"),
        concurrency: int | None = typer.Option(
            None, "--concurrency", min=1, help="concurrent requests"
        ),
        redis_url: str = _REDIS,
        prefix: str = _PREFIX,
    ) -> None:
        """Sets limits; options left out keep what applies now. Gateways see it within 1 s."""
        from gateway.admission import LimitPolicy
        from gateway.admission.manage import describe_limits, update_limits

        if rpm is None and tpm is None and concurrency is None:
            raise typer.BadParameter("give at least one of --rpm, --tpm, --concurrency")

        async def action(store: Any) -> dict[str, Any]:
            policy = LimitPolicy()
            await update_limits(
                store,
                policy,
                account,
                model,
                requests_per_minute=rpm,
                tokens_per_minute=tpm,
                max_concurrent=concurrency,
            )
            return await describe_limits(store, policy, account, model)

        _run(redis_url, prefix, action)

    @limits_app.command("show")
    def show_limits(
        account: str = _ACCOUNT,
        model: str | None = _MODEL,
        redis_url: str = _REDIS,
        prefix: str = _PREFIX,
    ) -> None:
        """Prints the account's overrides and the limits that apply (to --model, if given)."""
        from gateway.admission import LimitPolicy
        from gateway.admission.manage import describe_limits

        async def action(store: Any) -> dict[str, Any]:
            return await describe_limits(store, LimitPolicy(), account, model)

        _run(redis_url, prefix, action)

    app.add_typer(limits_app, name="limits")
