"""Where per-account limit overrides live: Redis for a fleet, a dict for one process."""

from __future__ import annotations

import json
from typing import Protocol

import redis.asyncio as redis

from gateway.admission.errors import InvalidLimits
from gateway.admission.limits import AccountLimits, Limits, check_identifier

# The field that holds the account-wide override inside an account's hash; model
# names never equal it because "*" is not an identifier character.
_ACCOUNT_FIELD = "*"


class LimitStore(Protocol):
    """Per-account overrides. `model=None` addresses the account-wide override."""

    async def load(self, account_id: str) -> AccountLimits:
        """Every override of the account (one round trip)."""
        ...

    async def save(self, account_id: str, limits: Limits, model: str | None = None) -> None: ...

    async def clear(self, account_id: str, model: str | None = None) -> bool:
        """Removes one override; False when there was none."""
        ...


class MemoryLimitStore:
    """Overrides in this process: `edgeserve up` and tests."""

    def __init__(self) -> None:
        self._accounts: dict[str, dict[str, Limits]] = {}

    async def load(self, account_id: str) -> AccountLimits:
        check_identifier("account id", account_id)
        fields = self._accounts.get(account_id, {})
        per_model = {k: v for k, v in fields.items() if k != _ACCOUNT_FIELD}
        return AccountLimits(account=fields.get(_ACCOUNT_FIELD), per_model=per_model)

    async def save(self, account_id: str, limits: Limits, model: str | None = None) -> None:
        self._accounts.setdefault(account_id, {})[_field(account_id, model)] = limits

    async def clear(self, account_id: str, model: str | None = None) -> bool:
        fields = self._accounts.get(account_id, {})
        return fields.pop(_field(account_id, model), None) is not None


class RedisLimitStore:
    """Overrides in one Redis hash per account: field "*" or a model name -> JSON limits."""

    def __init__(self, client: redis.Redis, prefix: str = "edgeserve") -> None:
        self._redis = client
        self._prefix = prefix

    def key(self, account_id: str) -> str:
        return f"{self._prefix}:limits:{check_identifier('account id', account_id)}"

    async def load(self, account_id: str) -> AccountLimits:
        raw = await self._redis.hgetall(self.key(account_id))
        fields = {_text(k): _parse(_text(v)) for k, v in raw.items()}
        per_model = {k: v for k, v in fields.items() if k != _ACCOUNT_FIELD}
        return AccountLimits(account=fields.get(_ACCOUNT_FIELD), per_model=per_model)

    async def save(self, account_id: str, limits: Limits, model: str | None = None) -> None:
        field = _field(account_id, model)
        await self._redis.hset(self.key(account_id), field, json.dumps(limits.to_dict()))

    async def clear(self, account_id: str, model: str | None = None) -> bool:
        field = _field(account_id, model)
        return bool(await self._redis.hdel(self.key(account_id), field))


def _field(account_id: str, model: str | None) -> str:
    check_identifier("account id", account_id)
    return _ACCOUNT_FIELD if model is None else check_identifier("model", model)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _parse(raw: str) -> Limits:
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InvalidLimits(f"stored limits are not JSON: {raw!r}") from exc
    if not isinstance(data, dict):
        raise InvalidLimits(f"stored limits are not an object: {raw!r}")
    return Limits.from_dict(data)
