"""API keys: each belongs to one account; only their sha256 is stored.

The plaintext is returned once by `create`. A key's public handle is its
`key_id` (the first 16 hex digits of the hash), used to list and revoke.
`lookup` caches answers for at most `cache_s` (1 s) so a revocation reaches
every gateway within a second while the hot path rarely touches Redis.

While Redis is away (`scheduler.store_watch`), a key this gateway confirmed within the
last `known_for_s` (10 minutes) keeps working; any other key is a 503, never admitted
unchecked. So a key revoked just before or during an outage works on until Redis
returns, and never longer than `known_for_s` after this gateway last confirmed it.

    KeyStore (protocol)
    ├── RedisKeyStore    fleets
    └── MemoryKeyStore   `edgeserve up`, tests
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import redis.asyncio as aioredis

from scheduler.store_watch import StoreAway, StoreWatch

ACCOUNT_ID_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
KEY_PREFIX = "es-"


class InvalidAccountIdError(ValueError):
    pass


@dataclass(frozen=True)
class ApiKeyInfo:
    key_id: str
    account_id: str
    created_at: float


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def key_id_of(key: str) -> str:
    return hash_key(key)[:16]


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def check_account_id(account_id: str) -> str:
    if not ACCOUNT_ID_PATTERN.match(account_id):
        raise InvalidAccountIdError(
            f"account id must be 1-64 of A-Z a-z 0-9 _ -, got {account_id!r}"
        )
    return account_id


class KeyStore(Protocol):
    async def create(self, account_id: str) -> str:
        """A new key for the account; the plaintext is returned here and never again."""
        ...

    async def add(self, key: str, account_id: str) -> ApiKeyInfo:
        """Register a key the operator chose (EDGESERVE_API_KEY)."""
        ...

    async def lookup(self, key: str) -> str | None:
        """The key's account, or None for an unknown or revoked key."""
        ...

    async def revoke(self, key_id: str) -> bool: ...

    async def list(self, account_id: str) -> list[ApiKeyInfo]: ...


class _LookupCache:
    """Positive answers only, for at most `ttl_s`: a new key works at once, a revoked one within ttl_s."""

    def __init__(
        self,
        ttl_s: float,
        max_entries: int = 100_000,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ttl_s = ttl_s
        self._max_entries = max_entries
        self._monotonic = monotonic
        self._entries: dict[str, tuple[str, float]] = {}

    def get(self, digest: str) -> str | None:
        entry = self._entries.get(digest)
        if entry is None:
            return None
        account_id, until = entry
        if self._monotonic() >= until:
            del self._entries[digest]
            return None
        return account_id

    def put(self, digest: str, account_id: str) -> None:
        if len(self._entries) >= self._max_entries:
            self._entries.clear()
        self._entries[digest] = (account_id, self._monotonic() + self._ttl_s)


class _KnownKeys:
    """Keys Redis confirmed, with when: what stands in for Redis while it is away. The
    `max_entries` most recently confirmed are kept."""

    def __init__(
        self, known_for_s: float, max_entries: int, monotonic: Callable[[], float]
    ) -> None:
        self._known_for_s = known_for_s
        self._max_entries = max_entries
        self._monotonic = monotonic
        self._entries: OrderedDict[str, tuple[str, float]] = (
            OrderedDict()
        )  # digest -> (account, confirmed at)

    def confirm(self, digest: str, account_id: str) -> None:
        self._entries[digest] = (account_id, self._monotonic())
        self._entries.move_to_end(digest)
        if len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)

    def forget(self, digest: str) -> None:
        self._entries.pop(digest, None)

    def get(self, digest: str) -> str | None:
        """The account of a key confirmed within `known_for_s`; None for any other."""
        entry = self._entries.get(digest)
        if entry is None or self._monotonic() - entry[1] > self._known_for_s:
            return None
        return entry[0]


class MemoryKeyStore:
    def __init__(self) -> None:
        self._by_digest: dict[str, ApiKeyInfo] = {}

    async def create(self, account_id: str) -> str:
        key = new_key()
        await self.add(key, account_id)
        return key

    async def add(self, key: str, account_id: str) -> ApiKeyInfo:
        info = ApiKeyInfo(key_id_of(key), check_account_id(account_id), time.time())
        self._by_digest[hash_key(key)] = info
        return info

    async def lookup(self, key: str) -> str | None:
        info = self._by_digest.get(hash_key(key))
        return None if info is None else info.account_id

    async def revoke(self, key_id: str) -> bool:
        for digest, info in list(self._by_digest.items()):
            if info.key_id == key_id:
                del self._by_digest[digest]
                return True
        return False

    async def list(self, account_id: str) -> list[ApiKeyInfo]:
        return sorted(
            (i for i in self._by_digest.values() if i.account_id == account_id),
            key=lambda i: (i.created_at, i.key_id),
        )


class RedisKeyStore:
    """Layout: `{p}apikey:{sha256}` hash (account_id, key_id, created_at),
    `{p}apikey_id:{key_id}` -> sha256, `{p}account_keys:{account}` set of key ids."""

    def __init__(
        self,
        client: aioredis.Redis,
        prefix: str = "edgeserve:",
        cache_s: float = 1.0,
        monotonic: Callable[[], float] = time.monotonic,  # the caches' clock; tests pass a fake
        *,
        watch: StoreWatch | None = None,
        known_for_s: float = 600.0,
        max_known: int = 100_000,
    ) -> None:
        self._redis = client
        self._prefix = prefix
        self._cache = _LookupCache(cache_s, monotonic=monotonic)
        self._watch = watch or StoreWatch(monotonic=monotonic)
        self._known = _KnownKeys(known_for_s, max_known, monotonic)

    async def create(self, account_id: str) -> str:
        key = new_key()
        await self.add(key, account_id)
        return key

    async def add(self, key: str, account_id: str) -> ApiKeyInfo:
        check_account_id(account_id)
        digest = hash_key(key)
        info = ApiKeyInfo(digest[:16], account_id, time.time())
        p = self._prefix
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(
                f"{p}apikey:{digest}",
                mapping={
                    "account_id": account_id,
                    "key_id": info.key_id,
                    "created_at": repr(info.created_at),
                },
            )
            pipe.set(f"{p}apikey_id:{info.key_id}", digest)
            pipe.sadd(f"{p}account_keys:{account_id}", info.key_id)
            await pipe.execute()
        return info

    async def lookup(self, key: str) -> str | None:
        digest = hash_key(key)
        cached = self._cache.get(digest)
        if cached is not None:
            return cached
        try:
            raw = await self._watch.call(
                lambda: self._redis.hget(f"{self._prefix}apikey:{digest}", "account_id")
            )
        except StoreAway:
            known = self._known.get(digest)
            if known is None:
                raise  # a key we cannot check now is never let in: 503
            return known
        if raw is None:
            self._known.forget(digest)
            return None
        account_id = _text(raw)
        self._cache.put(digest, account_id)
        self._known.confirm(digest, account_id)
        return account_id

    async def revoke(self, key_id: str) -> bool:
        p = self._prefix
        digest = await self._redis.get(f"{p}apikey_id:{key_id}")
        if digest is None:
            return False
        digest = _text(digest)
        account_id = await self._redis.hget(f"{p}apikey:{digest}", "account_id")
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(f"{p}apikey:{digest}", f"{p}apikey_id:{key_id}")
            if account_id is not None:
                pipe.srem(f"{p}account_keys:{_text(account_id)}", key_id)
            await pipe.execute()
        # Not served from what this gateway knew, should Redis go away after all.
        self._known.forget(digest)
        return True

    async def list(self, account_id: str) -> list[ApiKeyInfo]:
        p = self._prefix
        key_ids = sorted(
            _text(k) for k in await self._redis.smembers(f"{p}account_keys:{account_id}")
        )
        infos = []
        for key_id in key_ids:
            digest = await self._redis.get(f"{p}apikey_id:{key_id}")
            if digest is None:
                continue
            fields = await self._redis.hgetall(f"{p}apikey:{_text(digest)}")
            if fields:
                infos.append(ApiKeyInfo(key_id, account_id, float(fields[b"created_at"])))
        return sorted(infos, key=lambda i: (i.created_at, i.key_id))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
