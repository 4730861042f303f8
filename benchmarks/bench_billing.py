"""Billing throughput, measured side by side (not collected by pytest: no test_ prefix).

    .venv/bin/python benchmarks/bench_billing.py [--events 5000]
    .venv/bin/python benchmarks/bench_billing.py --smoke     # 100 events (CI)

1. Ledger inserts per second: SQLite vs PostgreSQL, one event per transaction vs
   batches of 100 (what the worker commits per XREADGROUP).
2. The gateway's cost per `record`: XADD to Redis, the fsynced journal (Redis
   down), and the in-process queue (`edgeserve up`).
3. The worker end to end: stream -> ledger events per second.

Uses REDIS_URL / DATABASE_URL like the tests; creates and drops its own
Postgres database and Redis keys.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psycopg
import redis
import redis.asyncio

from billing.events import UsageEvent
from billing.ledger import Ledger, PostgresLedger, SqliteLedger
from billing.sink import LocalUsageSink, RedisUsageSink
from billing.worker import BillingWorker, WorkerConfig

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


def events(n: int, tag: str) -> list[UsageEvent]:
    now = time.time()
    return [
        UsageEvent(f"{tag}-{i}", f"acct-{i % 7}", "moe-small", "node-1", 120, 40, 16, now, now,
                   "ok")
        for i in range(n)
    ]  # fmt: skip


def rate(n: int, seconds: float) -> float:
    return n / seconds


def time_inserts(make: Callable[[], Ledger], evs: list[UsageEvent], batch: int) -> float:
    ledger = make()
    start = time.perf_counter()
    for i in range(0, len(evs), batch):
        ledger.insert_many(evs[i : i + batch])
    elapsed = time.perf_counter() - start
    ledger.close()
    return rate(len(evs), elapsed)


async def time_sink_records(sink: object, evs: list[UsageEvent]) -> float:
    start = time.perf_counter()
    for e in evs:
        await sink.record(e)  # type: ignore[attr-defined]
    return (time.perf_counter() - start) / len(evs) * 1e6  # µs per record


async def time_sink_records_concurrently(
    sink: object, evs: list[UsageEvent], at_once: int
) -> float:
    start = time.perf_counter()
    for i in range(0, len(evs), at_once):
        await asyncio.gather(*(sink.record(e) for e in evs[i : i + at_once]))  # type: ignore[attr-defined]
    return (time.perf_counter() - start) / len(evs) * 1e6  # µs per record


async def time_worker(ledger: Ledger, evs: list[UsageEvent], stream: str) -> float:
    client = redis.asyncio.Redis.from_url(REDIS_URL)
    pipe = client.pipeline(transaction=False)
    for e in evs:
        pipe.xadd(stream, e.to_fields())
    await pipe.execute()
    worker = BillingWorker(client, ledger, WorkerConfig(stream_key=stream, block_ms=10))
    await worker.ensure_group()
    start = time.perf_counter()
    while (await worker.read_once()).num_new:
        pass
    elapsed = time.perf_counter() - start
    assert worker.num_new == len(evs)
    await client.aclose()
    return rate(len(evs), elapsed)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=5000)
    parser.add_argument("--smoke", action="store_true", help="100 events (CI)")
    args = parser.parse_args()
    n = 100 if args.smoke else args.events
    tmp = Path(tempfile.mkdtemp())
    db = f"edgeserve_billing_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(DATABASE_URL, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{db}"')
    pg_url = psycopg.conninfo.make_conninfo(DATABASE_URL, dbname=db)
    prefix = f"bench:billing:{uuid.uuid4().hex[:8]}:"
    try:
        print(f"1. ledger inserts, {n} events (events/s)")
        results = {}
        for name, make in (
            ("sqlite", lambda: SqliteLedger(tmp / f"l-{uuid.uuid4().hex}.sqlite3")),
            ("postgres", lambda: PostgresLedger(pg_url)),
        ):
            for batch in (1, 100):
                small = n // 10 if batch == 1 else n  # one commit per event is slow: fewer
                results[name, batch] = time_inserts(make, events(small, f"{name}{batch}"), batch)
                print(f"   {name:8} batch {batch:3}: {results[name, batch]:10.0f}")
        for name in ("sqlite", "postgres"):
            print(f"   {name}: batch 100 / batch 1 = {results[name, 100] / results[name, 1]:.1f}x")
        print(f"   sqlite / postgres at batch 100 = "
              f"{results['sqlite', 100] / results['postgres', 100]:.2f}x")  # fmt: skip

        print(f"2. gateway cost per record, {n} events (µs/record)")

        async def sinks() -> dict[str, float]:
            client = redis.asyncio.Redis.from_url(REDIS_URL)
            out = {}
            redis_sink = RedisUsageSink(client, prefix + "usage", tmp / "j1")
            out["redis XADD"] = await time_sink_records(redis_sink, events(n, "s"))
            dead = redis.asyncio.Redis(port=1, socket_connect_timeout=0.1)
            journal_sink = RedisUsageSink(dead, prefix + "x", tmp / "j2", skip_redis_s=3600)
            out["journal (Redis down)"] = await time_sink_records(
                journal_sink, events(n // 10, "j")
            )
            out["journal, 100 at once"] = await time_sink_records_concurrently(
                journal_sink, events(n, "jc"), 100
            )
            local = LocalUsageSink(SqliteLedger(tmp / "local.sqlite3"))
            out["in-process queue"] = await time_sink_records(local, events(n, "q"))
            await local.aclose()
            await client.aclose()
            return out

        costs = asyncio.run(sinks())
        for name, us in costs.items():
            print(f"   {name:22}: {us:8.1f}")
        print(f"   journal / XADD = {costs['journal (Redis down)'] / costs['redis XADD']:.1f}x")
        print(
            "   journal one by one / 100 at once (group commit) = "
            f"{costs['journal (Redis down)'] / costs['journal, 100 at once']:.1f}x"
        )

        print(f"3. worker, stream -> ledger, {n} events (events/s)")
        for name, ledger in (
            ("sqlite", SqliteLedger(tmp / "w.sqlite3")),
            ("postgres", PostgresLedger(pg_url)),
        ):
            throughput = asyncio.run(time_worker(ledger, events(n, f"w{name}"), prefix + name))
            ledger.close()
            print(f"   {name:8}: {throughput:10.0f}")
    finally:
        with psycopg.connect(DATABASE_URL, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE "{db}" WITH (FORCE)')
        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(match=prefix + "*"))
        if keys:
            client.delete(*keys)


if __name__ == "__main__":
    main()
