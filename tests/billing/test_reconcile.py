from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import redis.asyncio

from billing.ledger import SqliteLedger
from billing.reconcile import CLOCK_MARGIN_S, ReconcileReport, reconcile
from billing.worker import BillingWorker, WorkerConfig
from tests.billing.samples import make_event


async def test_reconcile_separates_gaps_from_in_flight_and_journaled_events(
    redis_client: redis.asyncio.Redis, key_prefix: str, tmp_path: Path
) -> None:
    stream = key_prefix + "usage"
    ledger = SqliteLedger(tmp_path / "ledger.sqlite3")
    worker = BillingWorker(
        redis_client, ledger, WorkerConfig(stream_key=stream, batch_size=4, consumer="w1")
    )
    await worker.ensure_group()
    for i in range(6):
        await redis_client.xadd(stream, make_event(f"req-{i}").to_fields())
    await redis_client.xadd(stream, {"request_id": "broken"})
    await redis_client.xadd(stream, make_event("req-0").to_fields())  # a replay
    assert (await worker.read_once()).num_new == 4  # req-0..3 billed and acknowledged
    # req-4 goes to a consumer that then dies; req-5, the broken entry and the replay are unread.
    await redis_client.xreadgroup("billing", "ghost", {stream: ">"}, count=1)
    # Something loses req-2's row after it was acknowledged: the gap reconcile must find.
    with sqlite3.connect(ledger.path) as conn:
        conn.execute("DELETE FROM usage_ledger WHERE request_id = 'req-2'")
    journal = tmp_path / "gateway.journal"
    journal.write_text(
        json.dumps(make_event("req-1").to_fields())
        + "\n"
        + json.dumps(make_event("req-j").to_fields())
        + "\n"
    )

    report = await reconcile(redis_client, ledger, stream, "billing", [journal])
    ((oldest, _),) = await redis_client.xrange(stream, count=1)
    assert report == ReconcileReport(
        num_stream_entries=8,
        num_stream_requests=6,
        num_pending_entries=1,
        num_unread_entries=3,
        num_journal_events=2,
        num_malformed_entries=1,
        missing_from_ledger=("req-2",),
        in_flight=("req-4", "req-5"),
        journal_unbilled=("req-j",),
        rows_checked_since=int(oldest.decode().split("-")[0]) / 1000 + CLOCK_MARGIN_S,
    )
    assert report.is_consistent is False
    ledger.close()


async def billing(
    redis_client: redis.asyncio.Redis, key_prefix: str, tmp_path: Path
) -> tuple[str, SqliteLedger, BillingWorker]:
    """A usage stream, a SQLite ledger and a worker whose group exists: (stream, ledger, worker)."""
    stream = key_prefix + "usage"
    ledger = SqliteLedger(tmp_path / "ledger.sqlite3")
    worker = BillingWorker(redis_client, ledger, WorkerConfig(stream_key=stream, block_ms=10))
    await worker.ensure_group()
    return stream, ledger, worker


async def test_a_fully_billed_stream_is_consistent(
    redis_client: redis.asyncio.Redis, key_prefix: str, tmp_path: Path
) -> None:
    stream, ledger, worker = await billing(redis_client, key_prefix, tmp_path)
    pipe = redis_client.pipeline(transaction=False)
    for i in range(1500):  # more than one XRANGE page
        pipe.xadd(stream, make_event(f"req-{i}").to_fields())
    await pipe.execute()
    while (await worker.read_once()).num_new:
        pass
    report = await reconcile(redis_client, ledger, stream, "billing")
    assert report.is_consistent
    assert (report.num_stream_entries, report.num_stream_requests) == (1500, 1500)
    assert (report.missing_from_ledger, report.in_flight) == ((), ())
    ledger.close()


async def test_reconcile_on_a_missing_stream_reports_nothing(
    redis_client: redis.asyncio.Redis, key_prefix: str, tmp_path: Path
) -> None:
    ledger = SqliteLedger(tmp_path / "ledger.sqlite3")
    report = await reconcile(redis_client, ledger, key_prefix + "absent", "billing")
    assert report == ReconcileReport(0, 0, 0, 0, 0, 0, (), (), ())
    ledger.close()


async def test_recent_rows_the_stream_does_not_back_or_that_differ_are_inconsistent(
    redis_client: redis.asyncio.Redis, key_prefix: str, tmp_path: Path
) -> None:
    stream, ledger, worker = await billing(redis_client, key_prefix, tmp_path)
    now = time.time()
    for rid in ("r-1", "r-2"):
        await redis_client.xadd(stream, make_event(rid, ended_at=now + 1).to_fields())
    assert (await worker.read_once()).num_new == 2
    journal = tmp_path / "gateway.journal"
    journal.write_text(json.dumps(make_event("r-j", ended_at=now + 1).to_fields()) + "\n")
    ledger.insert_many(
        [
            make_event("r-x", ended_at=now + 1),  # in no stream entry nor journal
            make_event("r-j", ended_at=now + 1),  # its event still in a journal
            make_event("r-old"),  # ended before the stream's oldest entry: trimmed long ago
        ]
    )
    with sqlite3.connect(ledger.path) as conn:
        conn.execute("UPDATE usage_ledger SET output_tokens = 999 WHERE request_id = 'r-2'")
        # no valid usage event at all (more cached tokens than input): it differs too
        conn.execute("UPDATE usage_ledger SET cached_tokens = 1000 WHERE request_id = 'r-1'")

    report = await reconcile(redis_client, ledger, stream, "billing", [journal], clock_margin_s=0)
    assert (report.unbacked_rows, report.differing_rows) == (("r-x",), ("r-1", "r-2"))
    assert report.missing_from_ledger == () and report.is_consistent is False
    assert report.to_json()["unbacked_rows"] == ["r-x"]
    # With the clocks' margin the rows are too recent to judge: consistent.
    assert (await reconcile(redis_client, ledger, stream, "billing", [journal])).unbacked_rows == ()
    ledger.close()


async def test_a_started_stream_is_open_until_billed_and_a_gap_past_the_open_limit(
    redis_client: redis.asyncio.Redis, key_prefix: str, tmp_path: Path
) -> None:
    stream = key_prefix + "usage"
    ledger = SqliteLedger(tmp_path / "ledger.sqlite3")
    worker = BillingWorker(redis_client, ledger, WorkerConfig(stream_key=stream, consumer="w1"))
    await worker.ensure_group()
    now = time.time()
    starts = {
        rid: make_event(rid, kind="start", status="cancelled", started_at=now, ended_at=now)
        for rid in ("s-ended", "s-orphan", "s-lost")
    }
    for event in starts.values():
        await redis_client.xadd(stream, event.to_fields())
    await redis_client.xadd(
        stream, make_event("s-ended", started_at=now, ended_at=now + 1).to_fields()
    )
    node = make_event("s-orphan", kind="node", started_at=now, ended_at=now + 2, output_tokens=7)
    await redis_client.xadd(stream, node.to_fields())
    assert (await worker.read_once()).num_new == 1  # the one end

    report = await reconcile(redis_client, ledger, stream, "billing")
    assert (report.open_starts, report.unbilled_starts) == (("s-lost", "s-orphan"), ())
    assert report.is_consistent is True
    # The orphan is billed from its start and node record; the lost one (its node's record
    # never came) is a gap once open past the limit.
    assert await worker.complete_orphans(now=now + 2 + 301) == 1
    later = await reconcile(redis_client, ledger, stream, "billing", now=now + 3601)
    assert (later.open_starts, later.unbilled_starts) == ((), ("s-lost",))
    assert later.is_consistent is False
    # Trimmed from the stream, the lost start is still named: the ledger keeps it open.
    await redis_client.delete(stream)
    await worker.ensure_group()
    trimmed = await reconcile(redis_client, ledger, stream, "billing", now=now + 3601)
    assert trimmed.unbilled_starts == ("s-lost",)
    ledger.close()
