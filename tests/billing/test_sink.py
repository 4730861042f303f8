"""The sinks against real Redis: a Redis server of the test's own is stopped mid-traffic."""

from __future__ import annotations

import asyncio
import json
from datetime import date
from pathlib import Path

import redis.asyncio

from billing.events import UsageEvent
from billing.journal import Journal
from billing.ledger import Ledger, SqliteLedger
from billing.sink import REPLAY_CHUNK, LocalUsageSink, RedisUsageSink
from billing.worker import BillingWorker, WorkerConfig
from tests.billing.conftest import RedisServer
from tests.billing.samples import make_event

STREAM = "usage"
DAYS = (date(2026, 11, 1), date(2026, 11, 30))


def client_for(server: RedisServer) -> redis.asyncio.Redis:
    # A stopped server refuses connections at once, so the timeouts only bound a slow
    # live one: long enough for 40 connections opened together on a loaded CI machine
    # (0.2 s once journaled 28 of 40 appends while Redis was up), short against a hang.
    return redis.asyncio.Redis.from_url(server.url, socket_connect_timeout=2.0, socket_timeout=2.0)


async def stream_request_ids(client: redis.asyncio.Redis) -> list[str]:
    entries = await client.xrange(STREAM)
    return [UsageEvent.from_fields(fields).request_id for _, fields in entries]


async def bill_everything(client: redis.asyncio.Redis, ledger: Ledger) -> BillingWorker:
    worker = BillingWorker(client, ledger, WorkerConfig(stream_key=STREAM, block_ms=10))
    await worker.ensure_group()
    while True:
        batch = await worker.read_once()
        if batch.num_new + batch.num_duplicate + batch.num_dead == 0:
            return worker


async def test_events_are_journaled_while_redis_is_down_and_replayed_when_it_returns(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    client = client_for(redis_server)
    journal = tmp_path / "gateway.journal"
    sink = RedisUsageSink(client, STREAM, journal, timeout_s=5.0, skip_redis_s=0)
    await asyncio.gather(*(sink.record(make_event(f"up-{i}")) for i in range(40)))
    assert (sink.num_streamed, sink.num_journaled) == (40, 0)

    redis_server.stop()
    await asyncio.gather(*(sink.record(make_event(f"down-{i}")) for i in range(25)))
    assert (sink.num_streamed, sink.num_journaled) == (40, 25)
    lines = journal.read_text().splitlines()
    assert sorted(json.loads(line)["request_id"] for line in lines) == sorted(
        f"down-{i}" for i in range(25)
    )

    redis_server.start()
    for i in range(35):
        await sink.record(make_event(f"back-{i}"))
    await sink.aclose()  # waits for the background replay the first success started
    assert (sink.num_streamed, sink.num_journaled, sink.num_replayed, sink.num_lost) == (
        75,
        25,
        25,
        0,
    )
    assert journal.read_text() == ""
    ids = await stream_request_ids(client)
    assert len(ids) == 100
    assert set(ids) == (
        {f"up-{i}" for i in range(40)}
        | {f"down-{i}" for i in range(25)}
        | {f"back-{i}" for i in range(35)}
    )
    await client.aclose()


async def test_redis_stopped_during_traffic_loses_no_event_and_bills_each_once(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    client = client_for(redis_server)
    sink = RedisUsageSink(client, STREAM, tmp_path / "gateway.journal", timeout_s=1.0)
    num_requests = 300
    recorded = asyncio.Event()
    outage = asyncio.Event()

    async def traffic() -> None:
        for i in range(num_requests):
            await sink.record(make_event(f"req-{i}", output_tokens=i))
            if i == 100:
                recorded.set()
                await outage.wait()  # keep serving through the stop, not around it
            await asyncio.sleep(0.002)

    async def blink() -> None:
        await recorded.wait()
        outage.set()
        await asyncio.to_thread(redis_server.stop)
        await asyncio.sleep(0.3)
        await asyncio.to_thread(redis_server.start)

    await asyncio.gather(traffic(), blink())
    await sink.replay_journal()  # whatever the background replay has not moved yet
    await sink.aclose()
    assert sink.num_journaled > 0
    assert sink.num_lost == 0
    assert sink.num_streamed + sink.num_journaled == num_requests

    ledger = SqliteLedger(tmp_path / "ledger.sqlite3")
    await bill_everything(client, ledger)
    assert ledger.count() == num_requests
    usage = ledger.daily_usage(*DAYS)
    assert sum(u.requests for u in usage) == num_requests
    assert sum(u.output_tokens for u in usage) == sum(range(num_requests))
    ledger.close()
    await client.aclose()


async def test_after_a_failure_the_sink_journals_without_waiting_on_redis_then_replays_alone(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    client = client_for(redis_server)
    journal = tmp_path / "gateway.journal"
    # The replay loop's first tick must come after the five records below, or it closes the
    # skip window early: Redis's restart blocks the event loop, so a short interval (it
    # was 0.05 s) elapsed during it on a slow machine and the tick ran at the first await.
    sink = RedisUsageSink(client, STREAM, journal, skip_redis_s=60, replay_interval_s=2.0)
    await sink.start()
    redis_server.stop()
    await sink.record(make_event("first"))  # fails against Redis, opens the skip window
    redis_server.start()
    for i in range(5):
        await sink.record(make_event(f"skipped-{i}"))  # journaled without trying Redis
    assert (sink.num_streamed, sink.num_journaled) == (0, 6)
    # No request ends from here on: the replay loop alone empties the journal.
    for _ in range(400):
        if sink.num_replayed == 6:
            break
        await asyncio.sleep(0.02)
    assert sink.num_replayed == 6
    assert journal.read_text() == ""
    assert await stream_request_ids(client) == ["first"] + [f"skipped-{i}" for i in range(5)]
    await sink.record(make_event("after"))  # the replay closed the skip window
    assert sink.num_streamed == 1
    await sink.aclose()
    await client.aclose()


async def test_events_ending_together_share_one_journal_fsync(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    client = client_for(redis_server)
    redis_server.stop()
    sink = RedisUsageSink(client, STREAM, tmp_path / "gateway.journal", skip_redis_s=60)
    await sink.record(make_event("first"))  # Redis fails: one write, and the skip window opens
    await asyncio.gather(*(sink.record(make_event(f"req-{i}")) for i in range(100)))
    assert (sink.num_journaled, sink.num_lost, sink.journal.num_writes) == (101, 0, 2)
    assert len(sink.journal.read().events) == 101
    await client.aclose()


async def test_a_journal_left_by_a_dead_gateway_is_replayed_at_start(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    client = client_for(redis_server)
    journal = tmp_path / "gateway.journal"
    lines = [json.dumps(make_event(f"old-{i}").to_fields()) for i in range(3)]
    # The last line was torn by the crash: set aside, not replayed, not fatal.
    journal.write_text("\n".join(lines) + '\n{"request_id": "torn')
    sink = RedisUsageSink(client, STREAM, journal)
    await sink.start()
    assert await stream_request_ids(client) == ["old-0", "old-1", "old-2"]
    assert journal.read_text() == ""
    assert (tmp_path / "gateway.journal.rejected").read_text() == '{"request_id": "torn\n'
    await client.aclose()


async def test_local_sink_writes_the_ledger_in_process(tmp_path: Path) -> None:
    ledger = SqliteLedger(tmp_path / "ledger.sqlite3")
    sink = LocalUsageSink(ledger, batch_size=16)
    for i in range(100):
        await sink.record(make_event(f"req-{i % 90}", output_tokens=i % 90))
    await sink.aclose()
    assert (sink.num_new, sink.num_duplicate) == (90, 10)
    assert ledger.count() == 90
    assert sum(u.output_tokens for u in ledger.daily_usage(*DAYS)) == sum(range(90))
    ledger.close()


def test_a_torn_last_line_keeps_to_itself_and_the_next_event_is_kept(tmp_path: Path) -> None:
    """A crash mid-write leaves a line without its newline; the next append must not glue
    its event onto it (both were set aside as one unparsable line)."""
    journal = Journal(tmp_path / "usage.journal")
    journal.append(make_event("req-1"))
    torn = '{"request_id": "req-2", "acco'
    with journal.path.open("a") as f:
        f.write(torn)
    journal.append(make_event("req-3"))
    contents = journal.read()
    assert [e.request_id for e in contents.events] == ["req-1", "req-3"]
    assert contents.rejected_lines == [torn]
    # and a journal that ends cleanly gets no blank line
    clean = Journal(tmp_path / "clean.journal")
    clean.append(make_event("req-1"))
    clean.append(make_event("req-2"))
    assert clean.path.read_text().count("\n") == 2


async def test_a_replay_cut_short_keeps_only_what_it_did_not_send(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """A long journal replays in chunks of REPLAY_CHUNK. Redis refusing writes midway (out
    of memory) leaves the journal holding the chunks not sent, which the next replay sends:
    once the journal had been re-sent whole on every attempt and never emptied."""
    client = client_for(redis_server)
    path = tmp_path / "gateway.journal"
    events = [make_event(f"j-{i}") for i in range(3 * REPLAY_CHUNK + 500)]
    Journal(path).append_many(events)
    await client.xadd(STREAM, make_event("probe").to_fields())
    used = int((await client.info("memory"))["used_memory"])
    # Room for part of the journal (stream entries take ~100-150 bytes each here): a
    # chunk past the first fails part way, where Redis's own accounting puts it.
    await client.config_set("maxmemory", str(used + 300 * REPLAY_CHUNK))
    await client.config_set("maxmemory-policy", "noeviction")
    sink = RedisUsageSink(client, STREAM, path, timeout_s=5.0)
    sent = await sink.replay_journal()
    assert 0 < sent < len(events) and sent % REPLAY_CHUNK == 0
    left = Journal(path).read()
    assert [e.request_id for e in left.events] == [e.request_id for e in events[sent:]]
    await client.config_set("maxmemory", "0")
    assert await sink.replay_journal() == len(events) - sent
    assert path.read_text() == ""
    ids = await stream_request_ids(client)
    # Every event once, those of the chunk that failed perhaps twice (the ledger absorbs it).
    assert set(ids) == {e.request_id for e in events} | {"probe"}
    assert len(ids) <= len(events) + 1 + REPLAY_CHUNK
    assert sink.num_replayed == len(events)
    await client.aclose()


def test_keep_leaves_only_the_events_given(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "gateway.journal")
    journal.append_many([make_event(f"k-{i}") for i in range(5)])
    journal.keep([make_event("k-3"), make_event("k-4")], ["torn"])
    assert [e.request_id for e in journal.read().events] == ["k-3", "k-4"]
    assert journal.rejected_path.read_text() == "torn\n"
    assert not (tmp_path / "gateway.journal.partial").exists()
    journal.keep([], [])
    assert journal.is_empty()
