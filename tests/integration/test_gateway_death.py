"""A gateway SIGKILLed mid-stream: every request whose client got a token is billed once.

A real `edgeserve gateway` process streams answers from a real SmolLM2 node (in a thread
of this process, recording its own usage on the stream, as `edgeserve node` does); it is
killed while six streams run, then restarted. The worker bills each orphaned stream from
its start and its node's record, and `edgeserve billing reconcile` finds nothing amiss.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio as aioredis

from billing.ledger import SqliteLedger
from billing.sink import RedisUsageSink
from billing.worker import BillingWorker, WorkerConfig
from gateway.keys import RedisKeyStore
from gpu_node.server import NodeService, NodeSettings, create_node_app
from scheduler.capacity import RedisCapacityRegistry
from tests.conftest import ACCOUNT_ID, INTERNAL_TOKEN, REDIS_URL, SMOLLM2, ServerThread, free_port

pytestmark = pytest.mark.timeout(300)

API_KEY = "es-gateway-death-key"
EDGESERVE = [sys.executable, "-c", "from edgeserve.cli import main; main()"]
NUM_STREAMS = 6
MAX_TOKENS = 400  # long enough that every stream is still running when the gateway dies


@dataclass
class Stream:
    request_id: str = ""
    num_chunks: int = 0  # chunks with text the client read
    ended_cleanly: bool = False  # it read [DONE]: the gateway died after this one ended
    first_token: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class Fleet:
    prefix: str
    port: int
    home: Path
    log: Path
    gateway: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start_gateway(self) -> None:
        self.gateway = subprocess.Popen(
            [*EDGESERVE, "gateway", "--port", str(self.port), "--redis-url", REDIS_URL,
             "--prefix", self.prefix, "--internal-token", INTERNAL_TOKEN],
            stdout=self.log.open("ab"), stderr=subprocess.STDOUT,
            env=os.environ | {"EDGESERVE_HOME": str(self.home)},
        )  # fmt: skip
        deadline = time.monotonic() + 180
        while True:
            assert self.gateway.poll() is None, self.log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the gateway never became ready"
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)


@pytest.fixture
def fleet(engine: Any, tmp_path: Path) -> Iterator[Fleet]:
    prefix = f"test:death-{uuid.uuid4().hex[:10]}:"
    node_port = free_port()
    client = aioredis.Redis.from_url(REDIS_URL)  # the node thread's loop alone uses it
    node = ServerThread(
        create_node_app(
            NodeService(
                NodeSettings(
                    "node-1",
                    f"http://127.0.0.1:{node_port}",
                    INTERNAL_TOKEN,
                    heartbeat_s=0.2,
                    ttl_s=30.0,
                ),
                RedisCapacityRegistry(client, prefix),
                engine=engine,
                usage_sink=RedisUsageSink(client, f"{prefix}usage", tmp_path / "node.journal"),
            )
        ),
        node_port,
    ).start()

    async def add_key() -> None:
        keys_client = aioredis.Redis.from_url(REDIS_URL)
        await RedisKeyStore(keys_client, prefix).add(API_KEY, ACCOUNT_ID)
        await keys_client.aclose()

    asyncio.run(add_key())
    fleet = Fleet(prefix, free_port(), tmp_path / "home", tmp_path / "gateway.log")
    try:
        fleet.start_gateway()
        yield fleet
    finally:
        if fleet.gateway is not None and fleet.gateway.poll() is None:
            fleet.gateway.terminate()
            fleet.gateway.wait(timeout=30)
        node.stop()
        sync = redis.Redis.from_url(REDIS_URL)
        keys = list(sync.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            sync.delete(*keys)
        sync.close()


async def _stream(http: httpx.AsyncClient, url: str, i: int, seen: Stream) -> None:
    body = {
        "model": SMOLLM2,
        "prompt": f"Count from {i} upwards, one number a line:",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
    }
    headers = {"authorization": f"Bearer {API_KEY}"}
    try:
        async with http.stream(
            "POST", f"{url}/v1/completions", json=body, headers=headers
        ) as response:
            assert response.status_code == 200
            seen.request_id = response.headers["x-request-id"]
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    seen.ended_cleanly = True
                elif line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                    seen.num_chunks += 1
                    seen.first_token.set()
    except httpx.HTTPError:
        pass  # the gateway died under it


def test_streams_cut_by_a_gateway_sigkill_are_each_billed_once(
    fleet: Fleet, tmp_path: Path
) -> None:
    streams = [Stream() for _ in range(NUM_STREAMS)]

    async def run_and_kill() -> None:
        async with httpx.AsyncClient(timeout=120) as http:
            tasks = [
                asyncio.ensure_future(_stream(http, fleet.url, i, s)) for i, s in enumerate(streams)
            ]
            await asyncio.wait_for(
                asyncio.gather(*(s.first_token.wait() for s in streams)), timeout=120
            )
            assert fleet.gateway is not None
            fleet.gateway.send_signal(signal.SIGKILL)
            await asyncio.gather(*tasks)

    asyncio.run(run_and_kill())
    assert fleet.gateway is not None and fleet.gateway.wait(timeout=10) == -signal.SIGKILL
    assert all(s.num_chunks >= 1 for s in streams)
    cut = [s for s in streams if not s.ended_cleanly]
    assert cut, "every stream had ended before the gateway died"

    fleet.start_gateway()  # restarted: it replays its journal, and serves again
    answer = httpx.post(
        f"{fleet.url}/v1/completions",
        json={"model": SMOLLM2, "prompt": "Hi", "max_tokens": 2, "temperature": 0},
        headers={"authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    assert answer.status_code == 200

    ledger_path = tmp_path / "ledger.sqlite3"
    ledger = SqliteLedger(ledger_path)
    stream_key = f"{fleet.prefix}usage"

    async def drain() -> BillingWorker:
        client = aioredis.Redis.from_url(REDIS_URL)
        config = WorkerConfig(stream_key=stream_key, block_ms=50, orphan_grace_s=1.0)
        worker = BillingWorker(client, ledger, config)
        await worker.ensure_group()
        wanted = {s.request_id for s in streams} | {answer.headers["x-request-id"]}
        deadline = time.monotonic() + 60
        while await asyncio.to_thread(ledger.missing, wanted):
            assert time.monotonic() < deadline, ledger.missing(wanted)
            await worker.read_once()
            await worker.complete_orphans()
        await client.aclose()
        return worker

    worker = asyncio.run(drain())
    # Every cut stream is completed from its start and its node's record; so is a stream
    # whose [DONE] went out just before the kill, ahead of its end record (billed ok).
    assert len(cut) <= worker.num_orphans <= len(streams)
    for s in streams:
        row = ledger.get(s.request_id)
        assert row is not None, s
        assert (row.account_id, row.model, row.node_id) == (ACCOUNT_ID, SMOLLM2, "node-1")
        assert row.status in ("ok", "cancelled")
        assert row.input_tokens > 0
        # Billed the tokens the node sent toward the client: at least what it read.
        assert s.num_chunks <= row.output_tokens <= MAX_TOKENS
    assert ledger.open_requests() == {}

    reconcile = subprocess.run(
        [*EDGESERVE, "billing", "reconcile", "--redis-url", REDIS_URL, "--sqlite",
         str(ledger_path), "--stream", stream_key, "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert reconcile.returncode == 0, reconcile.stdout + reconcile.stderr
    report = json.loads(reconcile.stdout)
    assert (report["missing_from_ledger"], report["open_starts"], report["unbilled_starts"]) == (
        [],
        [],
        [],
    )
    ledger.close()
