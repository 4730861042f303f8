"""The capacity registry: nodes publish what they can take, gateways read it.

A node publishes a `CapacityRecord` on every heartbeat with a TTL; a record
whose TTL has passed is never used (a node that died simply stops renewing it).

    CapacityRegistry (protocol)
    ├── RedisCapacityRegistry   fleets: one key per node with PEXPIRE, plus an index set
    └── LocalCapacityRegistry   `edgeserve up`: a dict in the process

`CapacityView` is what a gateway holds: a read cache over a registry that is
never older than one heartbeat and drops expired records on every read.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Protocol

import redis.asyncio as aioredis

from scheduler.store_watch import StoreAway, StoreWatch

# Names that become parts of the fleet's Redis keys (inside `{...}` cluster hash tags) and
# of usage events: node ids here, account ids and model names in gateway admission. So
# braces, whitespace and control characters are refused, and 256 characters is the most
# (what billing stores: billing/events.py MAX_TEXT).
IDENTIFIER = re.compile(r"[A-Za-z0-9@/_.:+=-]{1,256}")
IDENTIFIER_RULE = "1-256 characters of letters, digits and @/_.:+=-"


def check_node_id(node_id: str) -> str:
    """`node_id` when it can name a node (IDENTIFIER), else ValueError naming the rule."""
    if IDENTIFIER.fullmatch(node_id) is None:
        raise ValueError(f"node id {node_id!r} must be {IDENTIFIER_RULE}")
    return node_id


ROLES = ("mixed", "prefill", "decode")


@dataclass(frozen=True)
class CapacityRecord:
    """What one node can take right now; `published_at + ttl_s` is when it stops counting."""

    node_id: str
    address: str  # base URL of the node's internal API, e.g. http://10.0.0.5:8081
    role: str  # mixed | prefill | decode
    models: tuple[str, ...]
    num_pages: int
    num_free_pages: int
    page_size: int
    kv_dtype: str
    num_running: int
    num_waiting: int
    load: float  # 0 idle .. 1 pool full; above 1 when requests queue
    published_at: float  # epoch seconds
    ttl_s: float
    # What the node's model computes in (fp32, bf16, fp16): with kv_dtype, what a prefill
    # node and a decode node must share for one's KV to continue on the other
    activations: str
    # The longest request (prompt + max_tokens) the node takes: its model's context window
    # or what its KV pool holds, the smaller; 0 from a node before the field (unknown)
    max_request_tokens: int = 0
    # Tokens the node's model ran a second (prompt chunks and decode steps), lately
    tokens_per_s: float = 0.0
    # The served model's own sampling defaults (temperature, top_p, top_k), only those its
    # files state (a checkpoint's generation_config.json): what a request that names none gets
    generation_defaults: dict[str, float] = field(default_factory=dict)
    # The encoders among `models` (they embed text, they do not generate it), with the most
    # tokens each takes per input; the rest of `models` generate text
    embedding_models: dict[str, int] = field(default_factory=dict)

    @property
    def kv_kind(self) -> tuple[str, str]:
        """What a handoff between two nodes needs them to share (gpu_node/engine/handoff.KVSpec's
        dtypes; one model means one shape)."""
        return (self.kv_dtype, self.activations)

    @property
    def num_total_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def num_free_tokens(self) -> int:
        return self.num_free_pages * self.page_size

    def is_live(self, now: float) -> bool:
        return now < self.published_at + self.ttl_s

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> CapacityRecord:
        fields = json.loads(raw)
        fields["models"] = tuple(fields["models"])
        # a node from before the field: its own kind, paired only with nodes like it
        fields.setdefault("activations", "unknown")
        return cls(**fields)


def load_estimate(
    num_pages: int, num_free_pages: int, num_waiting: int, max_num_seqs: int
) -> float:
    """Share of the KV pool in use, plus the queue measured in batches (so a queue outranks a full pool)."""
    used = (num_pages - num_free_pages) / num_pages if num_pages else 1.0
    return round(used + num_waiting / max(1, max_num_seqs), 4)


class CapacityRegistry(Protocol):
    async def publish(self, record: CapacityRecord) -> None: ...

    async def remove(self, node_id: str) -> None: ...

    async def list_live(self) -> list[CapacityRecord]:
        """Every record whose TTL has not passed, in node id order."""
        ...


class LocalCapacityRegistry:
    """In-process registry for single-process mode; `clock` is wall time so records compare."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._records: dict[str, CapacityRecord] = {}
        self._clock = clock

    async def publish(self, record: CapacityRecord) -> None:
        self._records[record.node_id] = record

    async def remove(self, node_id: str) -> None:
        self._records.pop(node_id, None)

    async def list_live(self) -> list[CapacityRecord]:
        now = self._clock()
        return [r for _, r in sorted(self._records.items()) if r.is_live(now)]


class RedisCapacityRegistry:
    """One key per node (`{prefix}node:{id}`, PEXPIRE = TTL) and an index set of node ids.

    Redis expires the key itself, so a dead node vanishes without anyone
    cleaning up; the index set is pruned lazily when a member's key is gone.
    """

    def __init__(self, client: aioredis.Redis, prefix: str = "edgeserve:") -> None:
        self._redis = client
        self._index_key = f"{prefix}nodes"
        self._prefix = prefix

    def _node_key(self, node_id: str) -> str:
        return f"{self._prefix}node:{node_id}"

    async def publish(self, record: CapacityRecord) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(self._node_key(record.node_id), record.to_json(), px=int(record.ttl_s * 1000))
            pipe.sadd(self._index_key, record.node_id)
            await pipe.execute()

    async def remove(self, node_id: str) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._node_key(node_id))
            pipe.srem(self._index_key, node_id)
            await pipe.execute()

    async def list_live(self) -> list[CapacityRecord]:
        node_ids = sorted(
            m.decode() if isinstance(m, bytes) else m
            for m in await self._redis.smembers(self._index_key)
        )
        if not node_ids:
            return []
        raws = await self._redis.mget([self._node_key(n) for n in node_ids])
        now = time.time()
        live, gone = [], []
        for node_id, raw in zip(node_ids, raws, strict=True):
            if raw is None:
                gone.append(node_id)
                continue
            record = CapacityRecord.from_json(raw)
            # Clock skew between hosts aside, Redis expiry and this check agree.
            if record.is_live(now):
                live.append(record)
        if gone:
            await self._redis.srem(self._index_key, *gone)
        return live


@dataclass
class CapacityView:
    """A gateway's read cache over a registry: refreshed after `max_age_s`, expired records
    dropped on every read.

    While the store is away (`watch`), the records of the last refresh that answered stand
    in for fresh ones, each as if it were still live, for `outage_grace_s` from the start
    of the outage (nodes cannot publish meanwhile); past that, a StoreAway. When the store
    returns, a last-known record its node has not published again is kept for one record
    TTL more: the time the node takes to publish again. A node that fails a connection
    meanwhile is marked down by the placer as at any time.
    """

    registry: CapacityRegistry
    max_age_s: float
    clock: Callable[[], float] = time.time
    watch: StoreWatch = field(default_factory=StoreWatch)
    outage_grace_s: float = 60.0
    _records: list[CapacityRecord] = field(default_factory=list)
    _fetched_at: float = float("-inf")
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def live(self, model: str | None = None) -> list[CapacityRecord]:
        """Live records (of nodes serving `model`, when given), in node id order."""
        if self.clock() - self._fetched_at >= self.max_age_s:
            # One refresh at a time: the requests that arrive meanwhile reuse its answer.
            async with self._lock:
                if self.clock() - self._fetched_at >= self.max_age_s:
                    await self._refresh()
        now = self.clock()
        records = [r for r in self._records if r.is_live(now) or self._stands_in(r)]
        return [r for r in records if model is None or model in r.models]

    async def _refresh(self) -> None:
        fetched_at = self.clock()
        try:
            fresh = await self.watch.call(self.registry.list_live)
        except StoreAway:
            age = self.watch.outage_age_s()
            if age is None or age > self.outage_grace_s or self._fetched_at == float("-inf"):
                raise  # nothing last-known to stand in
            return  # the last-known records stand; the next read asks again
        known = {r.node_id for r in fresh}
        kept = [r for r in self._records if r.node_id not in known and self._stands_in(r)]
        self._records = sorted(fresh + kept, key=lambda r: r.node_id)
        self._fetched_at = fetched_at

    def _stands_in(self, record: CapacityRecord) -> bool:
        """Whether a last-known record counts as live although its TTL has passed: the store
        is away, or back for less than the record's TTL, within `outage_grace_s`."""
        age = self.watch.outage_age_s(settle_s=record.ttl_s)
        return age is not None and age <= self.outage_grace_s

    def invalidate(self) -> None:
        self._fetched_at = float("-inf")
