"""A fleet gateway's Redis-backed stores, sharing one `StoreWatch`.

Keys, admission, the capacity view, reservations and affinities all read one watch, so
the first call that finds Redis away degrades them all at once (known keys, local shares
of the limits, last-known capacity, reservations this gateway holds), and the first that
reaches it again brings them all back.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

from gateway.admission import AdmissionSettings, RedisLimiter, RedisLimitStore
from gateway.batch.store import RedisBatchStore
from gateway.keys import RedisKeyStore
from gateway.settings import GatewaySettings
from scheduler.capacity import CapacityView, RedisCapacityRegistry
from scheduler.placement import Placer, RedisAffinities, RedisReservations
from scheduler.store_watch import StoreWatch


@dataclass(frozen=True)
class RedisStores:
    """What `create_app` takes for a fleet (keys, placer, limiter, limit_store, batches)."""

    keys: RedisKeyStore
    placer: Placer
    limiter: RedisLimiter
    limit_store: RedisLimitStore
    registry: RedisCapacityRegistry
    watch: StoreWatch
    batches: RedisBatchStore


def redis_stores(
    client: aioredis.Redis,
    settings: GatewaySettings,
    admission: AdmissionSettings,
    prefix: str = "edgeserve:",
) -> RedisStores:
    """The stores of a gateway on `client`, every key under `prefix` (admission's under
    `admission.key_prefix`); every Redis call bounded by `admission.redis_timeout_s`."""
    watch = StoreWatch(admission.redis_timeout_s, admission.redis_retry_s)
    registry = RedisCapacityRegistry(client, prefix)
    view = CapacityView(
        registry,
        settings.capacity_max_age_s,
        watch=watch,
        outage_grace_s=settings.store_outage_grace_s,
    )
    placer = Placer(
        view,
        RedisReservations(client, prefix, settings.reservation_ttl_s, watch=watch),
        affinities=RedisAffinities(client, prefix, watch=watch),
    )
    limit_store = RedisLimitStore(client, admission.key_prefix)
    return RedisStores(
        keys=RedisKeyStore(client, prefix, watch=watch, known_for_s=settings.known_key_s),
        placer=placer,
        limiter=RedisLimiter(client, admission, limit_store, watch=watch),
        limit_store=limit_store,
        registry=registry,
        watch=watch,
        batches=RedisBatchStore(
            client,
            prefix,
            settings.batch_retention_s,
            settings.max_batch_queued_per_account,
            settings.batch_claim_s,
        ),
    )
