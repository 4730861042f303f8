"""Real Redis and PostgreSQL for the billing tests.

REDIS_URL (default redis://127.0.0.1:6379/0): each test gets its own key prefix,
deleted afterwards. Each Postgres ledger test starts from an empty table of the
session's database (`postgres_url`, tests/conftest.py). The events the tests write
come from tests/billing/samples.py.
"""

from __future__ import annotations

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

from billing.ledger import Ledger, PostgresLedger, SqliteLedger
from tests.conftest import REDIS_URL, free_port


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
