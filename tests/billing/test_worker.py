"""The stream worker against real Redis: exactly-once into the ledger, crash between commit and ack."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis.asyncio
import redis.exceptions

from billing.ledger import Ledger, PostgresLedger, SqliteLedger
from billing.worker import BillingWorker, WorkerConfig
from edgeserve.commands.billing import PAUSE_AFTER_COMMIT_ENV
from tests.billing.samples import make_event
from tests.conftest import REDIS_URL


def config(key_prefix: str, consumer: str, **overrides: object) -> WorkerConfig:
    values: dict[str, object] = {
        "stream_key": key_prefix + "usage",
        "group": "billing",
        "consumer": consumer,
        "block_ms": 50,
        "batch_size": 64,
    }
    values.update(overrides)
    return WorkerConfig(**values)  # type: ignore[arg-type]


async def wait_for(condition, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def dead_letters(client: redis.asyncio.Redis, cfg: WorkerConfig) -> list[dict]:
    """The dead-letter stream's entries' fields, oldest first; the group left nothing pending."""
    assert (await client.xpending(cfg.stream_key, cfg.group))["pending"] == 0
    return [fields for _, fields in await client.xrange(cfg.dead_letter_key)]


async def test_worker_bills_each_request_once_and_acknowledges_everything(
    redis_client: redis.asyncio.Redis, ledger: Ledger, key_prefix: str
) -> None:
    cfg = config(key_prefix, "w1")
    for i in range(240):
        await redis_client.xadd(cfg.stream_key, make_event(f"req-{i}", output_tokens=i).to_fields())
    for i in range(0, 240, 24):  # ten replays (say, from a gateway journal)
        await redis_client.xadd(cfg.stream_key, make_event(f"req-{i}", output_tokens=i).to_fields())
    worker = BillingWorker(redis_client, ledger, cfg)
    task = asyncio.create_task(worker.run())

    async def is_drained() -> bool:
        return worker.num_new + worker.num_duplicate == 250

    await wait_for(is_drained)
    worker.stop()
    await asyncio.wait_for(task, 5)
    assert (worker.num_new, worker.num_duplicate, worker.num_dead) == (240, 10, 0)
    assert ledger.count() == 240
    assert sum(u.output_tokens for u in ledger.daily_usage(*_days())) == sum(range(240))
    pending = await redis_client.xpending(cfg.stream_key, cfg.group)
    assert pending["pending"] == 0


async def test_a_malformed_entry_is_dead_lettered_and_acknowledged(
    redis_client: redis.asyncio.Redis, ledger: Ledger, key_prefix: str
) -> None:
    cfg = config(key_prefix, "w1")
    worker = BillingWorker(redis_client, ledger, cfg)
    await worker.ensure_group()
    bad_id = (await redis_client.xadd(cfg.stream_key, {"request_id": "x"})).decode()
    await redis_client.xadd(cfg.stream_key, make_event("req-1").to_fields())
    result = await worker.read_once()
    assert (result.num_new, result.num_duplicate, result.num_dead) == (1, 0, 1)
    assert await dead_letters(redis_client, cfg) == [
        {b"request_id": b"x", b"source_id": bad_id.encode()}
    ]
    assert ledger.count() == 1


async def test_a_count_past_the_ledgers_bigint_is_dead_lettered_and_billing_goes_on(
    redis_client: redis.asyncio.Redis, ledger: Ledger, key_prefix: str
) -> None:
    """One such entry had failed the batch's insert (bigint out of range) on every retry, and
    nothing after it was ever billed."""
    cfg = config(key_prefix, "w1")
    worker = BillingWorker(redis_client, ledger, cfg)
    await worker.ensure_group()
    huge = make_event("req-huge").to_fields() | {"input_tokens": str(10**20)}
    bad_id = (await redis_client.xadd(cfg.stream_key, huge)).decode()
    await redis_client.xadd(cfg.stream_key, make_event("req-1").to_fields())
    result = await worker.read_once()
    assert (result.num_new, result.num_duplicate, result.num_dead) == (1, 0, 1)
    assert await dead_letters(redis_client, cfg) == [
        {**{k.encode(): v.encode() for k, v in huge.items()}, b"source_id": bad_id.encode()}
    ]
    assert ledger.count() == 1


async def test_an_entry_delivered_to_two_consumers_is_dead_lettered_once(
    redis_client: redis.asyncio.Redis, ledger: Ledger, key_prefix: str
) -> None:
    """A slow consumer's entries are claimed by another, which bills them; when the slow one
    goes on, its copy of the malformed entry must not become a second dead letter (each
    consumer had written one before its XACK, so either could also crash between the two)."""
    cfg = config(key_prefix, "slow", claim_idle_ms=50)
    resume = asyncio.Event()
    stalled = asyncio.Event()

    async def stall(done: list[str]) -> None:
        stalled.set()
        await resume.wait()

    slow = BillingWorker(redis_client, ledger, cfg, after_commit=stall)
    await slow.ensure_group()
    bad_id = (await redis_client.xadd(cfg.stream_key, {"request_id": "x"})).decode()
    await redis_client.xadd(cfg.stream_key, make_event("req-1").to_fields())
    slow_read = asyncio.create_task(slow.read_once())
    await asyncio.wait_for(stalled.wait(), 10)  # its row is committed, nothing acknowledged

    async def idle_past_50_ms() -> bool:
        entries = await redis_client.xpending_range(cfg.stream_key, cfg.group, "-", "+", 10)
        return len(entries) == 2 and all(e["time_since_delivered"] >= 50 for e in entries)

    await wait_for(idle_past_50_ms)
    fast = BillingWorker(redis_client, ledger, config(key_prefix, "fast", claim_idle_ms=50))
    assert await fast.claim_idle() == 2
    assert (fast.num_new, fast.num_duplicate, fast.num_dead) == (0, 1, 1)
    resume.set()
    result = await asyncio.wait_for(slow_read, 10)
    assert (result.num_new, result.num_duplicate, result.num_dead) == (1, 0, 0)
    assert await dead_letters(redis_client, cfg) == [
        {b"request_id": b"x", b"source_id": bad_id.encode()}
    ]
    assert ledger.count() == 1


async def test_a_dead_letter_that_cannot_be_written_leaves_its_entry_pending(
    redis_client: redis.asyncio.Redis, ledger: Ledger, key_prefix: str
) -> None:
    """The script had acknowledged first: when its write then failed (a script is not
    rolled back), the entry was gone, with no letter, and the retry found nothing to do."""
    cfg = config(key_prefix, "w1", claim_idle_ms=1)
    worker = BillingWorker(redis_client, ledger, cfg)
    await worker.ensure_group()
    await redis_client.set(cfg.dead_letter_key, "not a stream")
    bad_id = (await redis_client.xadd(cfg.stream_key, {"request_id": "x"})).decode()
    with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
        await worker.read_once()
    assert (await redis_client.xpending(cfg.stream_key, cfg.group))["pending"] == 1
    await redis_client.delete(cfg.dead_letter_key)
    await asyncio.sleep(0.01)  # idle past claim_idle_ms
    assert await worker.claim_idle() == 1
    assert await dead_letters(redis_client, cfg) == [
        {b"request_id": b"x", b"source_id": bad_id.encode()}
    ]


async def test_the_dead_letter_stream_keeps_its_newest_entries(
    redis_client: redis.asyncio.Redis, ledger: Ledger, key_prefix: str
) -> None:
    cfg = config(key_prefix, "w1", dead_letter_max=3)
    worker = BillingWorker(redis_client, ledger, cfg)
    await worker.ensure_group()
    for i in range(5):
        await redis_client.xadd(cfg.stream_key, {"request_id": f"bad-{i}"})
    assert (await worker.read_once()).num_dead == 5
    dead = await dead_letters(redis_client, cfg)
    assert [fields[b"request_id"] for fields in dead] == [b"bad-2", b"bad-3", b"bad-4"]


async def test_an_entry_of_thousands_of_fields_is_dead_lettered_in_part(
    redis_client: redis.asyncio.Redis, ledger: Ledger, key_prefix: str
) -> None:
    """All its fields would overflow the dead-letter script's unpack on every retry."""
    cfg = config(key_prefix, "w1")
    worker = BillingWorker(redis_client, ledger, cfg)
    await worker.ensure_group()
    fields = {f"f{i}": str(i) for i in range(10_000)}
    bad_id = (await redis_client.xadd(cfg.stream_key, fields)).decode()
    await redis_client.xadd(cfg.stream_key, make_event("req-1").to_fields())
    result = await worker.read_once()
    assert (result.num_new, result.num_duplicate, result.num_dead) == (1, 0, 1)
    kept = {f"f{i}".encode(): str(i).encode() for i in range(256)}
    assert await dead_letters(redis_client, cfg) == [
        kept | {b"dropped_fields": b"9744", b"source_id": bad_id.encode()}
    ]


def test_a_negative_dead_letter_cap_is_refused() -> None:
    with pytest.raises(ValueError, match="dead_letter_max must be >= 0"):
        WorkerConfig(dead_letter_max=-1)


@pytest.mark.parametrize(
    "poison",
    [
        {b"model": b"\xff\xfe"},  # not UTF-8: decoding had raised outside the parse
        {b"ended_at": b"1793620801000.0"},  # milliseconds: no UTC day to bill it on
        {b"node_id": b"n\x00"},  # NUL: Postgres text holds none
        {b"request_id": b"r" * 8192},  # past Postgres's btree row
    ],
    ids=["not-utf8", "milliseconds", "nul", "long-id"],
)
async def test_an_entry_the_ledger_cannot_store_is_dead_lettered_and_billing_goes_on(
    redis_client: redis.asyncio.Redis, ledger: Ledger, key_prefix: str, poison: dict
) -> None:
    """Each of these had failed its batch's insert (or its parse) on every retry, wedging
    the group: nothing after it, nor the good events of its batch, was ever billed."""
    cfg = config(key_prefix, "w1")
    worker = BillingWorker(redis_client, ledger, cfg)
    await worker.ensure_group()
    await redis_client.xadd(cfg.stream_key, make_event("req-0").to_fields())
    fields = {k.encode(): v.encode() for k, v in make_event("req-bad").to_fields().items()}
    fields |= poison
    bad_id = (await redis_client.xadd(cfg.stream_key, fields)).decode()
    await redis_client.xadd(cfg.stream_key, make_event("req-1").to_fields())
    result = await worker.read_once()
    assert (result.num_new, result.num_duplicate, result.num_dead) == (2, 0, 1)
    assert await dead_letters(redis_client, cfg) == [fields | {b"source_id": bad_id.encode()}]
    assert ledger.count() == 2


async def test_a_restarted_consumer_first_bills_what_it_held_when_it_stopped(
    redis_client: redis.asyncio.Redis, ledger: Ledger, key_prefix: str
) -> None:
    cfg = config(key_prefix, "w1")
    worker = BillingWorker(redis_client, ledger, cfg)
    await worker.ensure_group()
    await redis_client.xadd(cfg.stream_key, make_event("req-1").to_fields())
    # Delivered to w1 but never processed (w1 crashed before inserting).
    await redis_client.xreadgroup(cfg.group, "w1", {cfg.stream_key: ">"})
    assert (await redis_client.xpending(cfg.stream_key, cfg.group))["pending"] == 1
    restarted = BillingWorker(redis_client, ledger, cfg)  # same consumer name, new process
    task = asyncio.create_task(restarted.run())

    async def is_billed() -> bool:
        return restarted.num_new == 1

    await wait_for(is_billed)
    restarted.stop()
    await asyncio.wait_for(task, 5)
    # Billed from its own pending list, not claimed: the entry was far from idle enough.
    assert restarted.num_claimed == 0
    assert ledger.count() == 1
    assert (await redis_client.xpending(cfg.stream_key, cfg.group))["pending"] == 0


@pytest.mark.parametrize("store", ["sqlite", "postgres"])
async def test_a_worker_killed_between_commit_and_ack_bills_nothing_twice(
    redis_client: redis.asyncio.Redis,
    key_prefix: str,
    tmp_path: Path,
    store: str,
    request: pytest.FixtureRequest,
) -> None:
    if store == "sqlite":
        location = ["--sqlite", str(tmp_path / "ledger.sqlite3")]
    else:
        url = request.getfixturevalue("postgres_url")
        PostgresLedger(url).close()  # make sure the table exists
        import psycopg

        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("DELETE FROM usage_ledger")
        location = ["--database-url", url]
    cfg = config(key_prefix, "survivor", claim_idle_ms=200)
    events = [make_event(f"req-{i}", input_tokens=10 + i, output_tokens=i) for i in range(5)]
    entry_ids = [(await redis_client.xadd(cfg.stream_key, e.to_fields())).decode() for e in events]
    marker = tmp_path / "committed"
    doomed = subprocess.Popen(
        [sys.executable, "-c", "from edgeserve.cli import main; main()", "billing", "worker",
         "--redis-url", REDIS_URL, *location, "--stream", cfg.stream_key, "--group", cfg.group,
         "--consumer", "doomed", "--claim-idle-ms", "600000"],
        env=os.environ | {PAUSE_AFTER_COMMIT_ENV: str(marker)},
        stderr=subprocess.PIPE,
    )  # fmt: skip
    try:

        async def has_committed() -> bool:
            assert doomed.poll() is None, doomed.stderr.read() if doomed.stderr else ""
            return marker.exists() and marker.read_text().endswith("\n")

        await wait_for(has_committed)
        assert marker.read_text().split() == entry_ids
        # The rows are committed, the entries are still pending: now the worker dies.
        ledger: Ledger = (
            SqliteLedger(tmp_path / "ledger.sqlite3")
            if store == "sqlite"
            else PostgresLedger(location[1])
        )
        assert ledger.count() == 5
        pending = await redis_client.xpending(cfg.stream_key, cfg.group)
        assert pending["pending"] == 5
        assert pending["consumers"] == [{"name": b"doomed", "pending": 5}]
        doomed.send_signal(signal.SIGKILL)
        assert doomed.wait(timeout=10) == -signal.SIGKILL
    finally:
        if doomed.poll() is None:
            doomed.kill()
            doomed.wait()

    # Not idle long enough: a live worker may still hold them. (Checked by a worker waiting
    # its default 30 s, so that a slow machine cannot let 200 ms pass before the check.)
    patient = BillingWorker(redis_client, ledger, config(key_prefix, "patient"))
    assert await patient.claim_idle() == 0

    async def idle_past_200_ms() -> bool:  # by Redis's own clock
        entries = await redis_client.xpending_range(cfg.stream_key, cfg.group, "-", "+", 10)
        return len(entries) == 5 and all(e["time_since_delivered"] >= 200 for e in entries)

    await wait_for(idle_past_200_ms)
    survivor = BillingWorker(redis_client, ledger, cfg)
    assert await survivor.claim_idle() == 5
    assert (survivor.num_new, survivor.num_duplicate) == (0, 5)
    assert (await redis_client.xpending(cfg.stream_key, cfg.group))["pending"] == 0
    assert ledger.count() == 5
    assert [ledger.get(e.request_id) for e in events] == events
    ledger.close()


def _days():  # type: ignore[no-untyped-def]
    from datetime import date

    return date(2026, 11, 1), date(2026, 11, 30)


async def test_the_worker_rides_out_a_redis_restart(redis_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    client = redis.asyncio.Redis.from_url(
        redis_server.url, socket_connect_timeout=0.2, socket_timeout=1.0
    )
    ledger = SqliteLedger(tmp_path / "ledger.sqlite3")
    cfg = WorkerConfig(stream_key="usage", consumer="w1", block_ms=50, retry_s=0.05)
    worker = BillingWorker(client, ledger, cfg)
    task = asyncio.create_task(worker.run())
    for i in range(10):
        await client.xadd("usage", make_event(f"before-{i}").to_fields())

    async def billed(n: int):  # type: ignore[no-untyped-def]
        async def check() -> bool:
            assert not task.done(), task
            return worker.num_new == n

        return check

    await wait_for(await billed(10))
    await asyncio.to_thread(redis_server.stop)
    await asyncio.sleep(0.3)  # the worker fails, logs and retries meanwhile
    await asyncio.to_thread(redis_server.start)
    producer = redis.asyncio.Redis.from_url(redis_server.url)  # no stale pooled connections
    for i in range(10):
        await producer.xadd("usage", make_event(f"after-{i}").to_fields())
    await producer.aclose()
    await wait_for(await billed(20))
    worker.stop()
    await asyncio.wait_for(task, 5)
    assert ledger.count() == 20
    assert (await client.xpending("usage", "billing"))["pending"] == 0
    ledger.close()
    await client.aclose()


async def test_trimming_keeps_pending_and_unread_entries(
    redis_client: redis.asyncio.Redis, key_prefix: str, tmp_path: Path
) -> None:
    ledger = SqliteLedger(tmp_path / "ledger.sqlite3")
    cfg = config(key_prefix, "w1", batch_size=2, retain_s=86_400)
    worker = BillingWorker(redis_client, ledger, cfg)
    await worker.ensure_group()
    for i in range(1, 6):  # ids 1000-0 .. 5000-0: ancient, all past the retention
        await redis_client.xadd(cfg.stream_key, make_event(f"req-{i}").to_fields(), id=f"{i}000-0")
    assert (await worker.read_once()).num_new == 2  # 1000-0, 2000-0 billed and acknowledged
    await redis_client.xreadgroup(cfg.group, "ghost", {cfg.stream_key: ">"}, count=1)  # 3000-0
    assert await worker.trim() == 2  # stops at the pending 3000-0; 4000-0, 5000-0 unread
    remaining = [entry_id for entry_id, _ in await redis_client.xrange(cfg.stream_key)]
    assert remaining == [b"3000-0", b"4000-0", b"5000-0"]
    assert await worker.trim(now=0.0) == 0  # nothing is older than the retention at epoch 0
    ledger.close()
