"""Reading and changing an account's limits: what the CLI and the admin API share."""

from __future__ import annotations

from typing import Any

from gateway.admission.limits import LimitPolicy, Limits, check_identifier
from gateway.admission.store import LimitStore
from gateway.catalog import ModelCatalog

_CATALOG = ModelCatalog()


def limits_model(model: str | None) -> str | None:
    """The name a per-model limit is kept under: the node model, which admission buckets by.

    A catalog name or alias (`@cf/huggingface/smollm2-135m-instruct`, `smollm2`) becomes its
    node model (`smollm2`), so a limit set by the public name is the one enforced; another
    name is kept as given.
    """
    if model is None:
        return None
    found = _CATALOG.resolve(model)
    return found.node_model if found is not None else model


async def describe_limits(
    store: LimitStore, policy: LimitPolicy, account_id: str, model: str | None = None
) -> dict[str, Any]:
    """The account's overrides and what applies to it (to `model`, when given)."""
    check_identifier("account id", account_id)
    model = limits_model(model)
    if model is not None:
        check_identifier("model", model)
    overrides = await store.load(account_id)
    effective = (
        policy.resolve(overrides, model)
        if model is not None
        else overrides.account or policy.default
    )
    return {
        "account_id": account_id,
        "model": model,
        "effective": effective.to_dict(),
        "account": overrides.account.to_dict() if overrides.account else None,
        "models": {m: limits.to_dict() for m, limits in sorted(overrides.per_model.items())},
    }


async def clear_limits(store: LimitStore, account_id: str, model: str | None = None) -> bool:
    """Drops the override of one scope (the account, or the account on one model); False
    when there was none."""
    return await store.clear(account_id, limits_model(model))


async def update_limits(
    store: LimitStore,
    policy: LimitPolicy,
    account_id: str,
    model: str | None = None,
    *,
    requests_per_minute: int | None = None,
    tokens_per_minute: int | None = None,
    max_concurrent: int | None = None,
) -> Limits:
    """Sets the override of one scope (the account, or the account on one model).

    Fields left out keep what applies to that scope now, so `--rpm 60` alone changes
    only the request limit. Returns the override as stored.
    """
    model = limits_model(model)
    current = await describe_limits(store, policy, account_id, model)
    scope = current["models"].get(model) if model is not None else current["account"]
    base = Limits.from_dict(scope or current["effective"])
    limits = base.updated(requests_per_minute, tokens_per_minute, max_concurrent)
    await store.save(account_id, limits, model)
    return limits
