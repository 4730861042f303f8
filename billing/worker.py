"""The billing worker: moves usage events from the Redis stream into the ledger, exactly once.

    XREADGROUP (new)  ─┐
    own pending (0)   ─┼─> parse -> ledger.insert_many (one commit) -> [after_commit hook] -> XACK
    XAUTOCLAIM (idle) ─┘

An entry is acknowledged only after its ledger row is committed. A worker that
dies between the commit and the ack leaves the entry pending; a live worker
claims it once it has been idle `claim_idle_ms` and inserts it again, which the
ledger's unique request id turns into a no-op. So the stream gives
at-least-once delivery and the ledger makes it exactly-once billing.

An entry that cannot be parsed is copied to `<stream>:dead` and acknowledged,
so one bad entry cannot wedge the group. Both happen in one script, and only for an
entry still pending: a crash cannot leave one without the other, a letter that cannot
be written leaves the entry pending (not lost), and an entry delivered to two consumers
(one claimed it from a slow one) is dead-lettered once. The dead-letter stream keeps
the newest `dead_letter_max` entries. (The script touches both keys: on Redis
Cluster give the stream a hash tag, `{edgeserve}:usage`, that `:dead` then shares.)
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from billing.errors import InvalidUsageEvent
from billing.events import UsageEvent
from billing.ledger import Ledger

log = logging.getLogger(__name__)

DEFAULT_STREAM = "edgeserve:usage"
DEFAULT_GROUP = "billing"

# Fields of an entry copied into its dead letter: far more than an event has, and few
# enough for the script's unpack (Lua's stack), which thousands would overflow.
_DEAD_LETTER_FIELDS = 256

AfterCommit = Callable[[list[str]], Awaitable[None]]

# KEYS: stream, dead-letter stream. ARGV: group, entry id, cap, then the entry's fields and
# values. Only an entry still pending is written, and it is acknowledged after its letter:
# a second delivery finds it acknowledged and writes nothing, and a write that fails (a
# script is not rolled back) leaves the entry pending, to be tried again, not lost.
_DEAD_LETTER = """
if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1) == 0 then
    return 0
end
local cap = tonumber(ARGV[3])
if cap > 0 then
    redis.call('XADD', KEYS[2], 'MAXLEN', cap, '*', unpack(ARGV, 4))
else
    redis.call('XADD', KEYS[2], '*', unpack(ARGV, 4))
end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
return 1
"""


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    stream_key: str = DEFAULT_STREAM
    group: str = DEFAULT_GROUP
    consumer: str = ""  # empty: hostname-pid
    batch_size: int = 100
    block_ms: int = 500  # how long one read waits; also bounds how late a stop is noticed
    claim_idle_ms: int = 30_000  # a pending entry idle this long belongs to a dead worker
    claim_interval_s: float = 5.0
    # Acknowledged entries older than this are trimmed (each claim round); reconciliation
    # can look back this far. 0 keeps the stream whole.
    retain_s: float = 7 * 86_400
    retry_s: float = 1.0  # pause after Redis or the ledger failed
    # The dead-letter stream keeps this many of its newest entries (0: all of them).
    dead_letter_max: int = 100_000
    # A stream whose start has no end once its node's record is this old lost its gateway
    # mid-answer: it is billed from the two (each claim round). An end comes within
    # moments of the node's record, or, from a gateway journaling while Redis is away,
    # when the journal replays: the grace covers such an outage.
    orphan_grace_s: float = 300.0
    # How long the ledger remembers a stream billed from its start and node record (a late
    # end replaces that row until then), and a node's record that no start joined.
    open_retain_s: float = 86_400.0

    def __post_init__(self) -> None:
        if not self.stream_key:
            raise ValueError("stream_key must not be empty")
        if not self.group:
            raise ValueError("group must not be empty")
        for name in ("batch_size", "block_ms", "claim_idle_ms"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.claim_interval_s <= 0 or self.retry_s <= 0:
            raise ValueError("claim_interval_s and retry_s must be positive")
        if self.retain_s < 0:
            raise ValueError("retain_s must be >= 0")
        if self.dead_letter_max < 0:
            raise ValueError("dead_letter_max must be >= 0")
        if self.orphan_grace_s < 0 or self.open_retain_s < 0:
            raise ValueError("orphan_grace_s and open_retain_s must be >= 0")

    @property
    def dead_letter_key(self) -> str:
        return f"{self.stream_key}:dead"

    def consumer_name(self) -> str:
        return self.consumer or f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True, slots=True)
class BatchResult:
    num_new: int
    num_duplicate: int
    num_dead: int


class BillingWorker:
    """One consumer of the billing group. Run it with `await worker.run()`; stop with `stop()`."""

    def __init__(
        self,
        redis_client: Any,
        ledger: Ledger,
        config: WorkerConfig | None = None,
        *,
        after_commit: AfterCommit | None = None,
    ) -> None:
        self._redis = redis_client
        self._ledger = ledger
        self.config = config or WorkerConfig()
        self.consumer = self.config.consumer_name()
        # A seam for the crash test: runs after the ledger commit and before the XACK.
        self._after_commit = after_commit
        self._dead_letter = redis_client.register_script(_DEAD_LETTER)
        self._stop = asyncio.Event()
        self.num_new = 0
        self.num_duplicate = 0
        self.num_dead = 0
        self.num_claimed = 0
        self.num_orphans = 0

    def stop(self) -> None:
        """Ask `run` to return after the batch in hand is committed and acknowledged."""
        self._stop.set()

    async def ensure_group(self) -> None:
        """Create the stream and the consumer group if missing (from the stream's start)."""
        try:
            await self._redis.xgroup_create(
                self.config.stream_key, self.config.group, id="0", mkstream=True
            )
        except Exception as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def run(self) -> None:
        """Bill until `stop()`. Redis or ledger trouble is logged and retried, never fatal:
        a batch that failed stays pending for this consumer and is billed again on recovery."""
        is_recovering = True  # at start: entries this consumer name held before a restart
        next_claim = 0.0
        while not self._stop.is_set():
            try:
                if is_recovering:
                    await self.ensure_group()
                    await self._drain_own_pending()
                    is_recovering = False
                if time.monotonic() >= next_claim:
                    await self.claim_idle()
                    await self.complete_orphans()
                    await self.trim()
                    next_claim = time.monotonic() + self.config.claim_interval_s
                await self.read_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning(
                    "billing worker %s: %s; retrying in %.1fs",
                    self.consumer,
                    exc,
                    self.config.retry_s,
                )
                is_recovering = True
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.config.retry_s)

    async def read_once(self) -> BatchResult:
        """Read and bill one batch of new entries (waits up to block_ms for them)."""
        reply = await self._redis.xreadgroup(
            self.config.group,
            self.consumer,
            {self.config.stream_key: ">"},
            count=self.config.batch_size,
            block=self.config.block_ms,
        )
        entries = reply[0][1] if reply else []
        return await self._process(entries)

    async def claim_idle(self) -> int:
        """Claim and bill entries left pending by dead consumers; returns how many."""
        start = "0-0"
        total = 0
        while True:
            reply = await self._redis.xautoclaim(
                self.config.stream_key,
                self.config.group,
                self.consumer,
                min_idle_time=self.config.claim_idle_ms,
                start_id=start,
                count=self.config.batch_size,
            )
            start, entries = _id(reply[0]), reply[1]
            # Entries trimmed from the stream while pending: nothing left to bill.
            deleted = [_id(d) for d in reply[2]] if len(reply) > 2 else []
            if deleted:
                await self._redis.xack(self.config.stream_key, self.config.group, *deleted)
            live = [e for e in entries if e is not None and e[1] is not None]
            if live:
                await self._process(live)
                total += len(live)
            if start == "0-0" or self._stop.is_set():
                break
        self.num_claimed += total
        return total

    async def complete_orphans(self, now: float | None = None) -> int:
        """Bill the streams whose gateway died mid-answer (WorkerConfig.orphan_grace_s), and
        forget open requests past WorkerConfig.open_retain_s; returns how many it billed."""
        now = now if now is not None else time.time()
        completed = await asyncio.to_thread(
            self._ledger.complete_orphans, now - self.config.orphan_grace_s
        )
        await asyncio.to_thread(self._ledger.forget_open, now - self.config.open_retain_s)
        for event in completed:
            log.warning(
                "request %s: its gateway never ended it; billed from its node's record (%s, "
                "%d output tokens)", event.request_id, event.status, event.output_tokens,
            )  # fmt: skip
        self.num_orphans += len(completed)
        return len(completed)

    async def trim(self, now: float | None = None) -> int:
        """Drop entries older than retain_s, but never one that is pending or not yet read:
        the cut stops at the oldest pending entry and at the group's last-delivered id."""
        if self.config.retain_s == 0:
            return 0
        cutoff_ms = int(((now if now is not None else time.time()) - self.config.retain_s) * 1000)
        summary = await self._redis.xpending(self.config.stream_key, self.config.group)
        if summary["pending"]:
            cutoff_ms = min(cutoff_ms, _ms(summary["min"]))
        for info in await self._redis.xinfo_groups(self.config.stream_key):
            cutoff_ms = min(cutoff_ms, _ms(info["last-delivered-id"]))
        if cutoff_ms <= 0:
            return 0
        # Exact (not "~") so the cut is where computed; one trim every claim round is cheap.
        trimmed = await self._redis.xtrim(
            self.config.stream_key, minid=f"{cutoff_ms}-0", approximate=False
        )
        return int(trimmed)

    async def _drain_own_pending(self) -> None:
        while not self._stop.is_set():
            reply = await self._redis.xreadgroup(
                self.config.group,
                self.consumer,
                {self.config.stream_key: "0"},
                count=self.config.batch_size,
            )
            entries = reply[0][1] if reply else []
            if not entries:
                return
            await self._process(entries)

    async def _process(self, entries: list[Any]) -> BatchResult:
        if not entries:
            return BatchResult(0, 0, 0)
        ids: list[str] = []
        events: list[UsageEvent] = []
        dead: list[tuple[str, Any]] = []
        for entry_id, fields in entries:
            try:
                events.append(UsageEvent.from_fields(fields))
                ids.append(_id(entry_id))
            except InvalidUsageEvent as exc:
                log.error("usage entry %s is malformed (%s); dead-lettered", _id(entry_id), exc)
                dead.append((_id(entry_id), fields))
        is_new = await asyncio.to_thread(self._ledger.insert_many, events) if events else []
        if self._after_commit is not None:
            await self._after_commit(ids + [entry_id for entry_id, _ in dead])
        num_dead = 0
        for entry_id, fields in dead:
            num_dead += await self._write_dead_letter(entry_id, fields)
        if ids:
            await self._redis.xack(self.config.stream_key, self.config.group, *ids)
        # Starts and nodes' records are news of a request, not billed rows.
        ends = [new for event, new in zip(events, is_new, strict=True) if event.kind == "end"]
        result = BatchResult(sum(ends), len(ends) - sum(ends), num_dead)
        self.num_new += result.num_new
        self.num_duplicate += result.num_duplicate
        self.num_dead += result.num_dead
        return result

    async def _write_dead_letter(self, entry_id: str, fields: dict[Any, Any]) -> int:
        """Copy `entry_id` to the dead-letter stream and acknowledge it, atomically; 0 when
        another delivery of it was acknowledged first (and wrote the dead letter)."""
        kept = dict(itertools.islice(fields.items(), _DEAD_LETTER_FIELDS))
        extra = {"dropped_fields": len(fields) - len(kept)} if len(fields) > len(kept) else {}
        pairs: list[Any] = []
        for name, value in {**kept, **extra, "source_id": entry_id}.items():
            pairs += [name, value]
        keys = [self.config.stream_key, self.config.dead_letter_key]
        args = [self.config.group, entry_id, self.config.dead_letter_max, *pairs]
        return int(await self._dead_letter(keys=keys, args=args))


def _ms(entry_id: bytes | str) -> int:
    return int(_id(entry_id).partition("-")[0])


def _id(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
