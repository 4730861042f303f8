"""The admission package's one config object, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from gateway.admission.errors import InvalidLimits
from gateway.admission.limits import LimitPolicy


@dataclass(frozen=True, slots=True)
class AdmissionSettings:
    """How the limiter behaves; every duration in seconds.

    on_redis_error: "open" falls back to this gateway's share of the limits (the limit
    divided by the live gateways last counted); "closed" raises AdmissionUnavailable.
    """

    policy: LimitPolicy = field(default_factory=LimitPolicy)
    on_redis_error: Literal["open", "closed"] = "open"
    redis_timeout_s: float = 0.25  # bound on every Redis call, so nothing hangs on a dead store
    redis_retry_s: float = 1.0  # after a failure, requests skip Redis this long before probing
    lease_s: float = 30.0  # a concurrency slot not renewed for this long frees itself
    heartbeat_s: float = 5.0  # registration and lease renewal period
    limits_cache_s: float = 1.0  # how stale a per-account override may be
    key_prefix: str = "edgeserve"

    def __post_init__(self) -> None:
        if self.on_redis_error not in ("open", "closed"):
            raise InvalidLimits(
                f"on_redis_error must be 'open' or 'closed', got {self.on_redis_error!r}"
            )
        for name in ("redis_timeout_s", "redis_retry_s", "lease_s", "heartbeat_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or value <= 0:
                raise InvalidLimits(f"{name} must be a positive number of seconds, got {value!r}")
        if self.limits_cache_s < 0:
            raise InvalidLimits(f"limits_cache_s must be >= 0, got {self.limits_cache_s!r}")
        if self.lease_s <= 2 * self.heartbeat_s:
            # Renewal runs every heartbeat; two missed beats must not cost a live request its slot.
            raise InvalidLimits(
                f"lease_s ({self.lease_s}) must exceed twice heartbeat_s ({self.heartbeat_s})"
            )
        if not self.key_prefix or any(c in self.key_prefix for c in "{} "):
            raise InvalidLimits(
                f"key_prefix must be non-empty without braces or spaces, got {self.key_prefix!r}"
            )

    @property
    def gateway_ttl_s(self) -> float:
        """A gateway that missed three heartbeats no longer counts as live."""
        return 3 * self.heartbeat_s
