"""Where queued batches wait and their answers are kept: Redis in a fleet, this process for
`edgeserve up` without Redis.

A batch is one record per account (its model, its request bodies, each request's answer
once it has one) kept `retention_s` past its last answer; its requests wait in one queue,
one entry a request, so that the gateways of a fleet share a batch's work. A worker
*claims* an entry, runs it and *completes* it (the answer written once, the entry gone);
a claim its worker stops renewing (the gateway died) lapses after `claim_s`, and the
entry is run again by whichever worker claims it next. In Redis:

    {prefix}batch:queue                 stream, group `batch-workers`: {account, batch, index}
    {prefix}batch:{account}:{batch_id}  hash: account, model, num_requests, num_done,
                                        started_at, req:{i}, res:{i}, attempts:{i}
    {prefix}batch:queued:{account}      the account's requests not yet answered (the bound)

Every step touches one key, so the keys may lie on different Cluster shards; writing an
answer is idempotent (HSETNX), so a step repeated after a crash counts once.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.exceptions import ResponseError
from redis.typing import EncodableT, FieldT

GROUP = "batch-workers"
# An account's count of unanswered requests goes down only while it exists: once lapsed
# (its batches expired unanswered), a late answer must not leave it below zero.
_DECR_IF_EXISTS = """
if redis.call('EXISTS', KEYS[1]) == 1 then return redis.call('DECRBY', KEYS[1], ARGV[1]) end
return 0
"""


def new_batch_id() -> str:
    return str(uuid.uuid4())


def is_batch_id(value: str) -> bool:
    """A batch id as `new_batch_id` writes them (anything else names no batch)."""
    try:
        return str(uuid.UUID(value)) == value
    except ValueError:
        return False


@dataclass(frozen=True)
class Claim:
    """One request of a batch, taken by a worker until it completes or releases it."""

    entry_id: str
    account_id: str
    batch_id: str
    index: int
    model: str  # the public model name the batch was queued for
    body: Any  # the request's body as the client sent it (validated when it runs)
    attempt: int  # 1 the first time it runs, more after a claim lapsed or was released
    consumer: str = ""  # the worker holding it (Redis: its consumer in the group)

    @property
    def request_id(self) -> str:
        """The request's id in usage and the ledger: one per attempt, the batch's id in it."""
        suffix = f"-{self.attempt}" if self.attempt > 1 else ""
        return f"{self.batch_id}-{self.index}{suffix}"


@dataclass(frozen=True)
class BatchView:
    """A batch as its account polls it."""

    batch_id: str
    model: str
    num_requests: int
    is_started: bool
    responses: dict[int, dict[str, Any]]  # index -> its `responses` entry, once answered

    @property
    def status(self) -> str:
        if len(self.responses) >= self.num_requests:
            return "done"
        return "running" if self.is_started else "queued"

    def result(self) -> dict[str, Any]:
        """Workers AI's poll answer: the status while it runs, then every answer in order
        with the batch's total usage."""
        if self.status != "done":
            return {"status": self.status, "request_id": self.batch_id, "model": self.model}
        responses = [self.responses[i] for i in range(self.num_requests)]
        total = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        for response in responses:
            usage = (response.get("result") or {}).get("usage") or {}
            for name in total:
                total[name] += int(usage.get(name, 0))
        return {"responses": responses, "usage": total}


class BatchStore(Protocol):
    async def submit(self, account_id: str, model: str, bodies: list[Any]) -> str | None:
        """Queues `bodies` as one batch; its id, or None when the account's queue has no
        room for them."""

    async def get(self, account_id: str, batch_id: str) -> BatchView | None:
        """`account_id`'s batch `batch_id`; None when unknown, expired or another's."""

    async def claim(self, consumer: str) -> Claim | None:
        """The next request to run (a lapsed claim first); None when none waits."""

    async def start(self, claim: Claim) -> None:
        """Marks `claim`'s batch running: one of its requests is going to a node."""

    async def renew(self, claim: Claim) -> None:
        """Keeps `claim` from lapsing while its request runs."""

    async def release(self, claim: Claim) -> None:
        """Gives `claim` back unanswered: the next claim takes it again."""

    async def complete(self, claim: Claim, response: dict[str, Any]) -> None:
        """Writes `claim`'s answer (the first one written stands) and ends its entry."""


@dataclass
class _LocalBatch:
    account_id: str
    model: str
    bodies: list[Any]
    expires_at: float
    attempts: dict[int, int] = field(default_factory=dict)
    is_started: bool = False
    responses: dict[int, dict[str, Any]] = field(default_factory=dict)


class LocalBatchStore:
    """Batches in this process (`edgeserve up` without Redis): gone when it stops."""

    def __init__(
        self,
        retention_s: float,
        max_queued_per_account: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._retention_s = retention_s
        self._max_queued = max_queued_per_account
        self._clock = clock
        self._batches: dict[str, _LocalBatch] = {}
        self._queue: deque[tuple[str, int]] = deque()
        self._num_claims = 0

    def _live(self, batch_id: str) -> _LocalBatch | None:
        batch = self._batches.get(batch_id)
        if batch is not None and self._clock() >= batch.expires_at:
            del self._batches[batch_id]
            return None
        return batch

    def _num_queued(self, account_id: str) -> int:
        return sum(
            len(b.bodies) - len(b.responses)
            for batch_id, b in list(self._batches.items())
            if b.account_id == account_id and self._live(batch_id) is not None
        )

    async def submit(self, account_id: str, model: str, bodies: list[Any]) -> str | None:
        if self._num_queued(account_id) + len(bodies) > self._max_queued:
            return None
        batch_id = new_batch_id()
        expires_at = self._clock() + self._retention_s
        self._batches[batch_id] = _LocalBatch(account_id, model, list(bodies), expires_at)
        self._queue.extend((batch_id, i) for i in range(len(bodies)))
        return batch_id

    async def get(self, account_id: str, batch_id: str) -> BatchView | None:
        batch = self._live(batch_id)
        if batch is None or batch.account_id != account_id:
            return None
        return BatchView(
            batch_id, batch.model, len(batch.bodies), batch.is_started, dict(batch.responses)
        )

    async def claim(self, consumer: str) -> Claim | None:
        while self._queue:
            batch_id, index = self._queue.popleft()
            batch = self._live(batch_id)
            if batch is None or index in batch.responses:
                continue
            batch.attempts[index] = attempt = batch.attempts.get(index, 0) + 1
            self._num_claims += 1
            return Claim(
                str(self._num_claims),
                batch.account_id,
                batch_id,
                index,
                batch.model,
                batch.bodies[index],
                attempt,
            )
        return None

    async def start(self, claim: Claim) -> None:
        if (batch := self._live(claim.batch_id)) is not None:
            batch.is_started = True

    async def renew(self, claim: Claim) -> None:
        pass  # a claim of this process lapses only with it

    async def release(self, claim: Claim) -> None:
        self._queue.appendleft((claim.batch_id, claim.index))

    async def complete(self, claim: Claim, response: dict[str, Any]) -> None:
        batch = self._live(claim.batch_id)
        if batch is not None and claim.index not in batch.responses:
            batch.responses[claim.index] = response
            batch.expires_at = self._clock() + self._retention_s


def _text(value: bytes | str | None) -> str:
    return value.decode() if isinstance(value, bytes) else (value or "")


class RedisBatchStore:
    """Batches in the fleet's Redis: any gateway answers a poll, and a batch outlives the
    gateway that queued it."""

    def __init__(
        self,
        client: aioredis.Redis,
        prefix: str,
        retention_s: float,
        max_queued_per_account: int,
        claim_s: float,
    ) -> None:
        self._redis = client
        self._prefix = prefix
        self._stream = f"{prefix}batch:queue"
        self._retention_ms = int(retention_s * 1000)
        self._max_queued = max_queued_per_account
        self._claim_ms = int(claim_s * 1000)
        self._has_group = False
        self._decr_if_exists = client.register_script(_DECR_IF_EXISTS)

    def _batch_key(self, account_id: str, batch_id: str) -> str:
        return f"{self._prefix}batch:{account_id}:{batch_id}"

    def _queued_key(self, account_id: str) -> str:
        return f"{self._prefix}batch:queued:{account_id}"

    async def _ensure_group(self) -> None:
        if self._has_group:
            return
        try:
            await self._redis.xgroup_create(self._stream, GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._has_group = True

    async def submit(self, account_id: str, model: str, bodies: list[Any]) -> str | None:
        await self._ensure_group()
        queued_key = self._queued_key(account_id)
        num_queued = await self._redis.incrby(queued_key, len(bodies))
        if num_queued > self._max_queued:
            await self._redis.decrby(queued_key, len(bodies))
            return None
        try:
            batch_id = await self._queue(account_id, model, bodies)
        except BaseException:
            await self._decr_if_exists(keys=[queued_key], args=[len(bodies)])
            raise
        await self._redis.pexpire(queued_key, self._retention_ms)
        return batch_id

    async def _queue(self, account_id: str, model: str, bodies: list[Any]) -> str:
        batch_id = new_batch_id()
        key = self._batch_key(account_id, batch_id)
        fields: dict[FieldT, EncodableT] = {
            "account": account_id,
            "model": model,
            "num_requests": len(bodies),
            "num_done": 0,
        }
        fields |= {f"req:{i}": json.dumps(body) for i, body in enumerate(bodies)}
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=fields)
            pipe.pexpire(key, self._retention_ms)
            await pipe.execute()
        async with self._redis.pipeline(transaction=False) as pipe:
            for i in range(len(bodies)):
                pipe.xadd(self._stream, {"account": account_id, "batch": batch_id, "index": i})
            await pipe.execute()
        return batch_id

    async def get(self, account_id: str, batch_id: str) -> BatchView | None:
        if not is_batch_id(batch_id):
            return None
        fields = await self._redis.hgetall(self._batch_key(account_id, batch_id))
        record = {_text(k): _text(v) for k, v in fields.items()}
        if record.get("account") != account_id or "num_requests" not in record:
            return None
        responses = {
            int(name.removeprefix("res:")): json.loads(value)
            for name, value in record.items()
            if name.startswith("res:")
        }
        return BatchView(
            batch_id,
            record["model"],
            int(record["num_requests"]),
            "started_at" in record,
            responses,
        )

    async def claim(self, consumer: str) -> Claim | None:
        await self._ensure_group()
        while True:
            entry = await self._next_entry(consumer)
            if entry is None:
                return None
            claim = await self._claim_of(consumer, *entry)
            if claim is not None:
                return claim

    async def _next_entry(self, consumer: str) -> tuple[str, dict[str, str]] | None:
        """A lapsed claim's entry, else a new one, now claimed by `consumer`."""
        reply = await self._redis.xautoclaim(
            self._stream, GROUP, consumer, self._claim_ms, start_id="0-0", count=1
        )
        entries = [e for e in reply[1] if e is not None and e[1]]
        if not entries:
            new: Any = await self._redis.xreadgroup(GROUP, consumer, {self._stream: ">"}, count=1)
            entries = new[0][1] if new else []
        if not entries:
            return None
        entry_id, fields = entries[0]
        return _text(entry_id), {_text(k): _text(v) for k, v in fields.items()}

    async def _claim_of(self, consumer: str, entry_id: str, entry: dict[str, str]) -> Claim | None:
        """The claim of a stream entry; None (the entry dropped) when its batch expired or
        the request has its answer already (its worker died before dropping the entry)."""
        account_id, batch_id, index = entry["account"], entry["batch"], int(entry["index"])
        key = self._batch_key(account_id, batch_id)
        model, body, answer = await self._redis.hmget(
            key, ["model", f"req:{index}", f"res:{index}"]
        )
        if model is None or body is None or answer is not None:
            await self._drop(entry_id)
            return None
        attempt = await self._redis.hincrby(key, f"attempts:{index}", 1)
        return Claim(
            entry_id,
            account_id,
            batch_id,
            index,
            _text(model),
            json.loads(body),
            int(attempt),
            consumer,
        )

    async def _drop(self, entry_id: str) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.xack(self._stream, GROUP, entry_id)
            pipe.xdel(self._stream, entry_id)
            await pipe.execute()

    async def start(self, claim: Claim) -> None:
        key = self._batch_key(claim.account_id, claim.batch_id)
        await self._redis.hsetnx(key, "started_at", f"{time.time():.3f}")

    async def renew(self, claim: Claim) -> None:
        await self._redis.xclaim(
            self._stream, GROUP, claim.consumer, 0, [claim.entry_id], justid=True
        )

    async def release(self, claim: Claim) -> None:
        # Idle as long as a lapsed claim: the next worker's XAUTOCLAIM takes it at once.
        await self._redis.xclaim(
            self._stream,
            GROUP,
            "released",
            0,
            [claim.entry_id],
            idle=self._claim_ms,
            justid=True,
        )

    async def complete(self, claim: Claim, response: dict[str, Any]) -> None:
        key = self._batch_key(claim.account_id, claim.batch_id)
        is_first = await self._redis.hsetnx(key, f"res:{claim.index}", json.dumps(response))
        if is_first:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hincrby(key, "num_done", 1)
                pipe.pexpire(key, self._retention_ms)
                await pipe.execute()
            await self._decr_if_exists(keys=[self._queued_key(claim.account_id)], args=[1])
        await self._drop(claim.entry_id)
