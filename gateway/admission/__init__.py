"""Admission control: per-account request, token and concurrency limits.

`RedisLimiter` enforces one limit across every gateway (one atomic Lua script per
check-and-take); `LocalLimiter` does the same in one process. `CapacityQueue` holds
requests fairly while no node has room.
"""

from gateway.admission.errors import (
    AdmissionError,
    AdmissionUnavailable,
    DuplicateRequestId,
    InvalidLimits,
    InvalidRequest,
)
from gateway.admission.limiter import Limiter
from gateway.admission.limits import AccountLimits, LimitPolicy, Limits
from gateway.admission.local import LocalLimiter
from gateway.admission.queue import CapacityQueue, Placed, Rejected
from gateway.admission.redis_limiter import RedisLimiter
from gateway.admission.result import Admission, Reason
from gateway.admission.settings import AdmissionSettings
from gateway.admission.store import LimitStore, MemoryLimitStore, RedisLimitStore

__all__ = [
    "AccountLimits",
    "Admission",
    "AdmissionError",
    "AdmissionSettings",
    "AdmissionUnavailable",
    "CapacityQueue",
    "DuplicateRequestId",
    "InvalidLimits",
    "InvalidRequest",
    "LimitPolicy",
    "LimitStore",
    "Limiter",
    "Limits",
    "LocalLimiter",
    "MemoryLimitStore",
    "Placed",
    "Reason",
    "RedisLimitStore",
    "RedisLimiter",
    "Rejected",
]
