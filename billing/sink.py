"""Where the gateway hands a finished request's usage: one non-blocking append.

    UsageSink (protocol)       record(event): never raises
    ├── RedisUsageSink         XADD to the usage stream; a local fsynced journal when Redis fails
    └── LocalUsageSink         no Redis (`edgeserve up`): an in-process queue drained into the ledger

Exactly-once is the ledger's job (unique request id), so a sink may deliver an
event twice (an XADD that timed out but landed, then replayed from the journal)
but must never lose one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Any, Protocol

from billing.events import UsageEvent
from billing.journal import Journal
from billing.ledger import Ledger

log = logging.getLogger(__name__)

# Journaled events a replay pipelines at once: one chunk's XADDs land within the timeout
# (50,000 took 2.1 s here), and a failure repeats at most one chunk.
REPLAY_CHUNK = 1000


class UsageSink(Protocol):
    async def record(self, event: UsageEvent) -> None:
        """Hand over one event. Never raises; returns after one append (stream, journal or queue)."""
        ...


class RedisUsageSink:
    """Appends events to a Redis stream, falling back to a local journal while Redis is away.

    The journal is replayed (pipelined XADDs, REPLAY_CHUNK at a time) as soon
    as an XADD succeeds again, every `replay_interval_s` once `start()`ed (which
    also replays what a previous process left behind), or by `replay_journal()`.
    After a failed XADD the sink journals directly for `skip_redis_s`. One journal
    file per gateway process.
    """

    def __init__(
        self,
        redis_client: Any,
        stream_key: str,
        journal_path: str | Path,
        *,
        timeout_s: float = 0.5,
        skip_redis_s: float = 1.0,
        replay_interval_s: float = 2.0,
    ) -> None:
        self._redis = redis_client
        self.stream_key = stream_key
        self.journal = Journal(journal_path)
        self._timeout_s = timeout_s
        # After a failed XADD, journal directly for this long: a Redis that hangs would
        # otherwise cost every ending request a full timeout.
        self._skip_redis_s = skip_redis_s
        self._replay_interval_s = replay_interval_s
        self._skip_redis_until = 0.0
        self._replay_loop: asyncio.Task[None] | None = None
        self._journal_waiting: list[tuple[UsageEvent, asyncio.Future[None]]] = []
        self._journal_writer: asyncio.Task[None] | None = None
        # Serialises journal appends with replays, so a replay never truncates a fresh line.
        self._journal_lock = asyncio.Lock()
        self._is_journal_pending = not self.journal.is_empty()
        self._replay_task: asyncio.Task[int] | None = None
        self.num_streamed = 0
        self.num_journaled = 0
        self.num_replayed = 0
        self.num_lost = 0

    async def start(self) -> None:
        """Replay what a previous process journaled, then keep replaying while Redis is away,
        so the journal empties when Redis returns even if no request ends meanwhile."""
        if self._is_journal_pending:
            await self.replay_journal()
        if self._replay_loop is None:
            self._replay_loop = asyncio.create_task(self._replay_periodically())

    async def record(self, event: UsageEvent) -> None:
        if time.monotonic() < self._skip_redis_until:
            await self._journal(event)
            return
        try:
            await asyncio.wait_for(
                self._redis.xadd(self.stream_key, event.to_fields()), self._timeout_s
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("usage stream unreachable (%s); journaling %s", exc, event.request_id)
            self._skip_redis_until = time.monotonic() + self._skip_redis_s
            await self._journal(event)
            return
        self.num_streamed += 1
        if self._is_journal_pending and self._replay_task is None:
            # Redis is back: replay in the background so this request's end is not delayed.
            self._replay_task = asyncio.create_task(self._replay_in_background())

    async def replay_journal(self) -> int:
        """Move journaled events to the stream, REPLAY_CHUNK a pipeline; returns how many
        landed. If Redis fails midway the journal keeps the events not yet sent (and the
        chunk that failed), so a long journal empties over attempts, never restarting."""
        async with self._journal_lock:
            contents = await asyncio.to_thread(self.journal.read)
            events = contents.events
            sent = 0
            try:
                while sent < len(events):
                    chunk = events[sent : sent + REPLAY_CHUNK]
                    pipe = self._redis.pipeline(transaction=False)
                    for event in chunk:
                        pipe.xadd(self.stream_key, event.to_fields())
                    await asyncio.wait_for(pipe.execute(), self._timeout_s * 10)
                    sent += len(chunk)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # Some of the failed chunk may have landed: the ledger's unique request id
                # absorbs the repeat.
                log.warning(
                    "journal replay failed after %d events (%s); keeping %d",
                    sent, exc, len(events) - sent,
                )  # fmt: skip
                if sent:
                    await asyncio.to_thread(
                        self.journal.keep, events[sent:], contents.rejected_lines
                    )
                    self.num_replayed += sent
                return sent
            await asyncio.to_thread(self.journal.clear, contents.rejected_lines)
            self._is_journal_pending = False
            self._skip_redis_until = 0.0
            self.num_replayed += len(events)
            return len(events)

    async def aclose(self) -> None:
        if self._replay_loop is not None:
            self._replay_loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_loop
            self._replay_loop = None
        if self._replay_task is not None:
            with contextlib.suppress(Exception):
                await self._replay_task

    async def _replay_periodically(self) -> None:
        while True:
            await asyncio.sleep(self._replay_interval_s)
            if self._is_journal_pending and self._replay_task is None:
                with contextlib.suppress(Exception):
                    await self.replay_journal()

    async def _replay_in_background(self) -> int:
        try:
            return await self.replay_journal()
        finally:
            self._replay_task = None

    async def _journal(self, event: UsageEvent) -> None:
        # Group commit: events that arrive while a write+fsync is under way share the next
        # one, so N requests ending together while Redis is down cost ~2 fsyncs, not N.
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._journal_waiting.append((event, done))
        if self._journal_writer is None:
            self._journal_writer = asyncio.create_task(self._write_journal())
        try:
            # shield: a request cancelled here still gets its event written by the writer.
            await asyncio.shield(done)
            self.num_journaled += 1
        except asyncio.CancelledError:
            raise
        except Exception:
            self.num_lost += 1
            log.exception(
                "usage event %s LOST: neither Redis nor the journal took it", event.request_id
            )

    async def _write_journal(self) -> None:
        try:
            while self._journal_waiting:
                batch, self._journal_waiting = self._journal_waiting, []
                try:
                    async with self._journal_lock:
                        await asyncio.to_thread(self.journal.append_many, [e for e, _ in batch])
                        self._is_journal_pending = True
                except Exception as exc:
                    for _, done in batch:
                        done.set_exception(exc)
                else:
                    for _, done in batch:
                        done.set_result(None)
        finally:
            self._journal_writer = None


class LocalUsageSink:
    """No Redis: events go to an in-process queue; a task writes them to the ledger in batches.

    Events still queued when the process dies are lost; `aclose()` drains the
    queue, so a graceful stop loses nothing.
    """

    def __init__(self, ledger: Ledger, *, batch_size: int = 256, retry_s: float = 1.0) -> None:
        self._ledger = ledger
        self._queue: asyncio.Queue[UsageEvent] = asyncio.Queue()
        self._batch_size = batch_size
        self._retry_s = retry_s
        self._task: asyncio.Task[None] | None = None
        self.num_new = 0
        self.num_duplicate = 0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._drain_forever())

    async def record(self, event: UsageEvent) -> None:
        if event.kind != "end":
            # In one process a gateway that dies takes the node with it: no start could be
            # completed from a node's record, and the queue dies with both.
            return
        self.start()
        self._queue.put_nowait(event)

    async def flush(self) -> None:
        """Wait until every event recorded so far is committed to the ledger."""
        await self._queue.join()

    async def aclose(self) -> None:
        if self._task is None:
            return
        await self.flush()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None

    async def _drain_forever(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while len(batch) < self._batch_size and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            while True:
                try:
                    is_new = await asyncio.to_thread(self._ledger.insert_many, batch)
                    break
                except Exception:
                    # Never drop a batch: a ledger that is briefly locked or down gets retried.
                    log.exception("ledger write failed; retrying %d events", len(batch))
                    await asyncio.sleep(self._retry_s)
            self.num_new += sum(is_new)
            self.num_duplicate += len(is_new) - sum(is_new)
            for _ in batch:
                self._queue.task_done()
