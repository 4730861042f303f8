"""What a gateway is wired with, in one process (`up`) or on a fleet's Redis, and what
runs beside it: keys, placement, admission, the usage sink, the ledger, and `up`'s own
billing worker and API key."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from edgeserve.settings import DEFAULT_REDIS_URL, journal_path, redis_client
from edgeserve.stores import command_ledger, ledger_location

if TYPE_CHECKING:
    from gateway.settings import GatewaySettings


class GatewayStores:
    """What a gateway is wired with, in-process or in Redis, and what runs beside it."""

    def __init__(
        self, keys: Any, registry: Any, placer: Any, limiter: Any, limit_store: Any,
        policy: Any, sink: Any, ledger: Any, ledger_location: str, client: Any = None,
        worker: Any = None, prefix: str = "", batches: Any = None,
    ) -> None:  # fmt: skip
        self.keys, self.registry, self.placer = keys, registry, placer
        self.limiter, self.limit_store, self.policy = limiter, limit_store, policy
        self.sink, self.ledger, self.ledger_location = sink, ledger, ledger_location
        self._client, self._worker, self._prefix = client, worker, prefix
        self.batches = batches  # None: the gateway keeps queued batches in its own process
        self._worker_task: asyncio.Task[None] | None = None
        self._up_key: tuple[str, str] | None = None  # (key id, marker) of a generated key

    async def add_up_key(self, account_id: str, chosen: str | None, owner: str) -> str:
        """The API key an `up` prints: `chosen` (EDGESERVE_API_KEY) as given, else a new one.

        A generated key lives as long as its `up`. In Redis it is revoked when `up` stops,
        and its id is kept under `{prefix}up_key:{owner}` (host and port, as the usage
        journal is named) so that the next start there revokes it after a crash: restarts
        never pile up keys. A chosen key is never revoked."""
        from gateway.keys import key_id_of, new_key

        key = chosen or new_key()
        if self._client is None:  # in-process keys end with the process
            await self.keys.add(key, account_id)
            return key
        marker = f"{self._prefix}up_key:{owner}"
        previous = await self._client.get(marker)
        if previous is not None and previous.decode() != key_id_of(key):
            await self.keys.revoke(previous.decode())
        await self.keys.add(key, account_id)
        if chosen is None:
            await self._client.set(marker, key_id_of(key))
            self._up_key = (key_id_of(key), marker)
        else:
            await self._client.delete(marker)
        return key

    def app_kwargs(self) -> dict[str, Any]:
        """create_app's store arguments (the app starts and stops the limiter itself)."""
        return {
            "keys": self.keys, "placer": self.placer, "limiter": self.limiter,
            "limit_store": self.limit_store, "limit_policy": self.policy,
            "usage_sink": self.sink, "ledger": self.ledger,
            "on_startup": self.start, "on_shutdown": self.close,
            "store_ping": self._client.ping if self._client is not None else None,
            "batches": self.batches,
        }  # fmt: skip

    async def start(self) -> None:
        start = getattr(self.sink, "start", None)  # the Redis sink replays its journal
        if start is not None and asyncio.iscoroutine(result := start()):
            await result
        if self._worker is not None:
            self._worker_task = asyncio.create_task(self._worker.run(), name="billing-worker")

    async def close(self) -> None:
        close = getattr(self.sink, "aclose", None)
        if close is not None:
            await close()  # the local sink drains into the ledger before the ledger closes
        if self._worker_task is not None:
            self._worker.stop()  # returns after its batch in hand is committed and acked
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker_task
        if self._up_key is not None:
            await self._revoke_up_key(*self._up_key)
        if self._client is not None:
            await self._client.aclose()
        self.ledger.close()

    async def _revoke_up_key(self, key_id: str, marker: str) -> None:
        from redis.exceptions import RedisError

        try:
            await self.keys.revoke(key_id)
            await self._client.delete(marker)
        except (RedisError, OSError) as exc:
            typer.echo(f"the API key stays in Redis until the next start here: {exc}", err=True)


async def gateway_stores(
    redis_url: str | None,
    prefix: str,
    port: int,
    settings: GatewaySettings,
    *,
    local: bool,
    ledger: str | Path | None = None,
    on_redis_error: str = "open",
    redis_timeout_s: float = 0.25,
    run_billing_worker: bool = False,
) -> GatewayStores:
    from billing.sink import LocalUsageSink, RedisUsageSink
    from billing.worker import BillingWorker, WorkerConfig
    from gateway.admission import AdmissionSettings, LimitPolicy, LocalLimiter
    from gateway.keys import MemoryKeyStore
    from gateway.stores import redis_stores
    from scheduler.capacity import CapacityView, LocalCapacityRegistry
    from scheduler.placement import LocalReservations, Placer

    shown_location = ledger_location(ledger)  # never a database password
    ledger_db = command_ledger(ledger, create=True)
    policy = LimitPolicy()
    if local:
        registry = LocalCapacityRegistry()
        placer = Placer(CapacityView(registry, max_age_s=1.0), LocalReservations())
        limiter = LocalLimiter(policy)
        return GatewayStores(
            MemoryKeyStore(), registry, placer, limiter, limiter.store, policy,
            LocalUsageSink(ledger_db), ledger_db, shown_location,
        )  # fmt: skip

    client = redis_client(redis_url or DEFAULT_REDIS_URL)
    stream_key = f"{prefix}usage"
    admission = AdmissionSettings(
        policy=policy,
        key_prefix=prefix.rstrip(":"),
        on_redis_error="closed" if on_redis_error == "closed" else "open",
        redis_timeout_s=redis_timeout_s,
    )
    # One watch over Redis for keys, limits, capacity and reservations: while Redis is
    # away they serve known keys from what they last knew (gateway/stores.py).
    fleet = redis_stores(client, settings, admission, prefix)
    worker = None
    if run_billing_worker:
        worker = BillingWorker(client, ledger_db, WorkerConfig(stream_key=stream_key))
    return GatewayStores(
        fleet.keys, fleet.registry, fleet.placer, fleet.limiter, fleet.limit_store, policy,
        RedisUsageSink(client, stream_key, journal_path(port)), ledger_db, shown_location,
        client, worker, prefix, fleet.batches,
    )  # fmt: skip
