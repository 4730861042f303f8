"""Real Redis and PostgreSQL for the billing tests.

REDIS_URL (default redis://127.0.0.1:6379/0): each test gets its own key prefix,
deleted afterwards. DATABASE_URL (default postgres on 127.0.0.1:5432): one fresh
database per test session, dropped at the end; each Postgres ledger test starts
from an empty table.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psycopg
import pytest
import redis
import redis.asyncio

from billing.events import UsageEvent
from billing.ledger import Ledger, PostgresLedger, SqliteLedger
from tests.conftest import free_port

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")

# 2026-11-02 12:00:00 UTC and the two days after it.
DAY1 = 1_793_620_800.0
DAY2 = DAY1 + 86_400
DAY3 = DAY2 + 86_400


def make_event(request_id: str, /, **overrides: object) -> UsageEvent:
    values: dict[str, object] = {
        "request_id": request_id,
        "account_id": "acct-a",
        "model": "@cf/huggingface/smollm2-135m-instruct",
        "node_id": "node-1",
        "input_tokens": 100,
        "output_tokens": 20,
        "cached_tokens": 0,
        "started_at": DAY1,
        "ended_at": DAY1 + 1.5,
        "status": "ok",
    }
    values.update(overrides)
    return UsageEvent(**values)  # type: ignore[arg-type]


@pytest.fixture
def key_prefix() -> Iterator[str]:
    prefix = f"test:billing:{uuid.uuid4().hex}:"
    yield prefix
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=prefix + "*"))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
async def redis_client() -> AsyncIterator[redis.asyncio.Redis]:
    client = redis.asyncio.Redis.from_url(REDIS_URL)
    yield client
    await client.aclose()


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    name = f"edgeserve_billing_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(DATABASE_URL, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    url = psycopg.conninfo.make_conninfo(DATABASE_URL, dbname=name)
    yield url
    with psycopg.connect(DATABASE_URL, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


@pytest.fixture(params=["sqlite", "postgres"])
def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Ledger]:
    store: Ledger
    if request.param == "sqlite":
        store = SqliteLedger(tmp_path / "ledger.sqlite3")
    else:
        url = request.getfixturevalue("postgres_url")
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("DROP TABLE IF EXISTS usage_ledger")
            conn.execute("DROP TABLE IF EXISTS usage_open")
        store = PostgresLedger(url)
    yield store
    store.close()


class RedisServer:
    """A redis-server of the test's own, on a free port, that the test can stop and restart."""

    def __init__(self, directory: Path) -> None:
        self.port = free_port()
        self.directory = directory
        self.process: subprocess.Popen[bytes] | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed (apt-get install redis-server)")
        self.process = subprocess.Popen(
            [
                binary,
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--save",
                "",
                # Persist every write, so a stop/restart loses nothing but the outage itself.
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--dir",
                str(self.directory),
            ],
            stdout=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_timeout=0.5)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        client.close()

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()
