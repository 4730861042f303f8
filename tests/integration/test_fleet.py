"""Two gateways and two nodes sharing Redis: spread, a node killed mid-run, retry, TTL expiry.

node-a is a real `edgeserve node` process (so it can be killed with SIGKILL);
node-b and both gateways are uvicorn servers in threads of this process. Every
server has its own Redis client; all share one key prefix of this test's own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from gateway.app import create_app
from gateway.keys import RedisKeyStore
from gateway.settings import GatewaySettings
from gpu_node.server import NodeService, NodeSettings, create_node_app
from scheduler.capacity import CapacityRecord, CapacityView, RedisCapacityRegistry
from scheduler.placement import Candidate, Placement, Placer, RedisReservations
from tests.conftest import (
    INTERNAL_TOKEN,
    REDIS_URL,
    SMOLLM2,
    ListSink,
    ServerThread,
    free_port,
)
from tests.loopback import ADMIN_TOKEN

TTL_S = 3.0  # node-a's: its expiry is under test, so short, yet 15 heartbeats long
# The gateways probe a node silent for SILENCE_S, and give it PROBE_S to answer.
SILENCE_S, PROBE_S = 1.0, 2.0
NODE_B_TTL_S = 30.0  # node-b's expiry is not under test: a loaded machine must not lapse it
HEARTBEAT_S = 0.2
KV_MEMORY_MB = 48  # the shared test engine's size, so both nodes start with equal free KV
MESSAGES = [{"role": "user", "content": "Say something."}]
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"


class RecordingPlacer(Placer):
    """A real placer that also keeps every placement it made (to show where requests went)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.placements: list[tuple[float, Placement]] = []

    async def place(self, *args: Any, **kwargs: Any) -> Placement | None:
        placement = await super().place(*args, **kwargs)
        if placement is not None:
            self.placements.append((time.monotonic(), placement))
        return placement


@dataclass
class Fleet:
    node_a: subprocess.Popen[bytes]
    node_a_log: Path
    node_b: ServerThread
    gateways: list[ServerThread]
    placers: list[RecordingPlacer]
    sinks: list[ListSink]
    api_key: str
    prefix: str

    def events(self) -> list[Any]:
        return [e for sink in self.sinks for e in sink.events]

    def placements(self, since: float = 0.0) -> list[str]:
        made = sorted((t, p.node_id) for placer in self.placers for t, p in placer.placements)
        return [node_id for t, node_id in made if t >= since]

    def records(self) -> list[CapacityRecord]:
        async def read() -> list[CapacityRecord]:
            client = aioredis.Redis.from_url(REDIS_URL)
            try:
                return await RedisCapacityRegistry(client, self.prefix).list_live()
            finally:
                await client.aclose()

        return asyncio.run(read())

    def live_nodes(self) -> list[str]:
        return [r.node_id for r in self.records()]


def start_gateway(prefix: str) -> tuple[ServerThread, RecordingPlacer, ListSink]:
    client = aioredis.Redis.from_url(REDIS_URL)  # used only by this gateway's event loop
    placer = RecordingPlacer(
        CapacityView(RedisCapacityRegistry(client, prefix), max_age_s=HEARTBEAT_S),
        RedisReservations(client, prefix),
    )
    sink = ListSink()
    app = create_app(
        GatewaySettings(
            internal_token=INTERNAL_TOKEN,
            capacity_max_age_s=HEARTBEAT_S,
            node_silence_s=SILENCE_S,
            node_probe_timeout_s=PROBE_S,
            admin_token=ADMIN_TOKEN,
        ),
        keys=RedisKeyStore(client, prefix),
        placer=placer,
        usage_sink=sink,
        on_shutdown=client.aclose,
    )
    return ServerThread(app).start(), placer, sink


def spawn_node_a(prefix: str, log: Path) -> subprocess.Popen[bytes]:
    """node-a as a real `edgeserve node` process on a port of its own (gateways find its
    address in its capacity record)."""
    port = free_port()
    return subprocess.Popen(
        [sys.executable, "-c", "from edgeserve.cli import main; main()", "node",
         "--port", str(port), "--node-id", "node-a", "--redis-url", REDIS_URL, "--prefix", prefix,
         "--internal-token", INTERNAL_TOKEN, "--heartbeat-s", str(HEARTBEAT_S), "--ttl-s", str(TTL_S),
         "--max-model-len", "1024", "--kv-memory-mb", str(KV_MEMORY_MB)],
        stdout=log.open("ab"), stderr=subprocess.STDOUT,
    )  # fmt: skip


def wait_both_live(fleet: Fleet) -> None:
    deadline = time.monotonic() + 120
    while fleet.live_nodes() != ["node-a", "node-b"]:
        if fleet.node_a.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"node-a did not come up:\n{fleet.node_a_log.read_text()[-3000:]}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def fleet(engine, tmp_path_factory) -> Iterator[Fleet]:
    prefix = f"test:fleet-{os.getpid()}-{time.monotonic_ns()}:"
    log = Path(tmp_path_factory.mktemp("fleet")) / "node-a.log"
    node_a = spawn_node_a(prefix, log)
    try:
        fleet = _start_the_rest(prefix, log, node_a, engine)
    except BaseException:  # a process left behind would heartbeat into Redis for good
        node_a.kill()
        node_a.wait(timeout=10)
        raise
    yield fleet
    if fleet.node_a.poll() is None:
        fleet.node_a.send_signal(signal.SIGTERM)
        fleet.node_a.wait(timeout=30)
    for gateway in fleet.gateways:
        gateway.stop()
    fleet.node_b.stop()
    # Leave nothing behind under the prefix.
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=f"{prefix}*"))
    if keys:
        client.delete(*keys)
    client.close()


def _start_the_rest(prefix: str, log: Path, node_a: subprocess.Popen[bytes], engine) -> Fleet:
    port_b = free_port()
    service_b = NodeService(
        NodeSettings(
            "node-b",
            f"http://127.0.0.1:{port_b}",
            INTERNAL_TOKEN,
            heartbeat_s=HEARTBEAT_S,
            ttl_s=NODE_B_TTL_S,
        ),
        RedisCapacityRegistry(aioredis.Redis.from_url(REDIS_URL), prefix),
        engine=engine,
    )
    node_b = ServerThread(create_node_app(service_b), port_b).start()
    started = [start_gateway(prefix) for _ in range(2)]

    async def add_key() -> str:
        client = aioredis.Redis.from_url(REDIS_URL)
        try:
            return await RedisKeyStore(client, prefix).create("acct-fleet")
        finally:
            await client.aclose()

    fleet = Fleet(
        node_a, log, node_b,
        [g for g, _, _ in started], [p for _, p, _ in started], [s for _, _, s in started],
        asyncio.run(add_key()), prefix,
    )  # fmt: skip
    wait_both_live(fleet)
    return fleet


async def chat(
    client: httpx.AsyncClient, fleet: Fleet, gateway: int, max_tokens: int = 4
) -> httpx.Response:
    return await client.post(
        f"{fleet.gateways[gateway].url}/v1/chat/completions",
        json={"model": SMOLLM2, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0},
        headers={"authorization": f"Bearer {fleet.api_key}"},
    )


async def burst(fleet: Fleet, n: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=60) as client:
        return await asyncio.gather(*(chat(client, fleet, i % 2) for i in range(n)))


def test_concurrent_requests_spread_over_both_nodes(fleet) -> None:
    after, after_wall = time.monotonic(), time.time()  # this test's own (any order in the module)
    responses = asyncio.run(burst(fleet, 6))
    assert [r.status_code for r in responses] == [200] * 6
    texts = {r.json()["choices"][0]["message"]["content"] for r in responses}
    assert len(texts) == 1  # same greedy answer, whichever node served it
    served = [e.node_id for e in fleet.events() if e.started_at >= after_wall]
    assert len(served) == 6
    assert sorted(set(served)) == ["node-a", "node-b"]
    assert set(fleet.placements(since=after)) == {"node-a", "node-b"}


def open_counting_stream(fleet: Fleet, stack: contextlib.ExitStack) -> Iterator[str]:
    response = stack.enter_context(
        httpx.stream(
            "POST",
            f"{fleet.gateways[0].url}/v1/completions",
            # Counting goes on far past what runs before the kill: the stream is cut mid-run.
            json={
                "model": SMOLLM2,
                "prompt": COUNTING,
                "max_tokens": 400,
                "stream": True,
                "temperature": 0,
            },
            headers={"authorization": f"Bearer {fleet.api_key}"},
            timeout=60,
        )
    )
    lines = (line for line in response.iter_lines() if line)
    assert next(lines).startswith("data: ")
    return lines


def hold_on(fleet: Fleet, node_id: str, num_tokens: int | None) -> None:
    """Hold `num_tokens` reserved on a node in the fleet's real reservation table, as a
    request would (None: let them go)."""

    async def go() -> None:
        client = aioredis.Redis.from_url(REDIS_URL)
        try:
            reservations = RedisReservations(client, fleet.prefix)
            if num_tokens is None:
                await reservations.release(node_id, "test-hold")
            else:
                unlimited = Candidate(node_id, 0, 2**40, 0)
                assert await reservations.reserve_best("test-hold", num_tokens, [unlimited]) == 0
        finally:
            await client.aclose()

    asyncio.run(go())


@pytest.fixture
def node_a_back_after(fleet: Fleet) -> Iterator[None]:
    """A test that kills node-a leaves a new one behind, for the module's other tests
    (worksteal can run them after it on the same fleet)."""
    yield
    if fleet.node_a.poll() is not None:
        fleet.node_a = spawn_node_a(fleet.prefix, fleet.node_a_log)
        wait_both_live(fleet)
        time.sleep(HEARTBEAT_S)  # the gateways' capacity caches turn over


def stream_on_node_a(fleet: Fleet, stack: contextlib.ExitStack) -> Iterator[str]:
    """A counting stream that runs on node-a, its first line read.

    Left to the scores, it may not: node-b can hold the account's prefix affinity, and a
    stream that ends early gives its reservation back. A hold of node-b's whole pool on it
    makes node-a score higher whenever a gateway sees node-a; on a loaded machine a
    heartbeat can lapse for a moment, and a gateway then sees node-b alone, so streams are
    opened until one runs on node-a."""
    (record_b,) = [r for r in fleet.records() if r.node_id == "node-b"]
    hold_on(fleet, "node-b", record_b.num_total_tokens)
    try:
        deadline = time.monotonic() + 30
        while True:
            while sorted(fleet.live_nodes()) != ["node-a", "node-b"]:
                assert time.monotonic() < deadline, f"live nodes: {fleet.live_nodes()}"
                time.sleep(0.05)
            lines = open_counting_stream(fleet, stack)
            if fleet.placements()[-1] == "node-a":
                return lines
            assert time.monotonic() < deadline, f"placements: {fleet.placements()}"
    finally:
        hold_on(fleet, "node-b", None)


def test_a_node_killed_mid_run_drops_out_after_its_ttl(fleet, node_a_back_after) -> None:
    with contextlib.ExitStack() as stack:
        lines = stream_on_node_a(fleet, stack)
        fleet.node_a.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        rest = list(lines)
    # The stream ends with an error event in the OpenAI dialect, no [DONE].
    assert json.loads(rest[-1].removeprefix("data: "))["error"] == {
        "message": "the node serving this request failed mid-answer",  # no node named
        "type": "server_error",
        "param": None,
        "code": "upstream_error",
    }
    fleet.node_a.wait(timeout=10)

    # Before the TTL passes node-a may still be chosen; a failed connect retries on node-b.
    early = asyncio.run(burst(fleet, 2))
    assert [r.status_code for r in early] == [200, 200]

    while "node-a" in fleet.live_nodes():
        assert time.monotonic() - killed_at < TTL_S + 1.0, "node-a outlived its TTL"
        time.sleep(0.05)
    time.sleep(HEARTBEAT_S)  # the gateways' capacity caches turn over
    after, after_wall = time.monotonic(), time.time()
    responses = asyncio.run(burst(fleet, 4))
    assert [r.status_code for r in responses] == [200] * 4
    assert fleet.placements(since=after) == ["node-b"] * 4
    assert [e.node_id for e in fleet.events() if e.started_at >= after_wall] == ["node-b"] * 4
    assert fleet.live_nodes() == ["node-b"]


def test_a_node_frozen_mid_answer_fails_its_stream_in_seconds(fleet, node_a_back_after) -> None:
    """SIGSTOP: a hung node's sockets stay open, so its stream had waited out the read
    timeout (300 s). Silent for SILENCE_S and unanswering its health probe, the node's
    stream now ends with an error event within seconds."""
    with contextlib.ExitStack() as stack:
        lines = stream_on_node_a(fleet, stack)
        fleet.node_a.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            rest = list(lines)
            waited = time.monotonic() - stopped_at
        finally:
            fleet.node_a.send_signal(signal.SIGKILL)
            fleet.node_a.wait(timeout=10)
    assert json.loads(rest[-1].removeprefix("data: "))["error"] == {
        "message": "the node serving this request failed mid-answer",
        "type": "server_error",
        "param": None,
        "code": "upstream_error",
    }
    assert waited < SILENCE_S + PROBE_S + 5.0, waited
    # The dashboard's recent errors list the stream, though its status line said 200.
    numbers = httpx.get(
        f"{fleet.gateways[0].url}/admin/v1/dashboard",
        headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
    ).json()["result"]
    failed = [(e["method"], e["path"], e["status"], e["message"]) for e in numbers["errors"]]
    assert failed[0] == (
        "POST", "/v1/completions", 502, "the node serving this request failed mid-answer"
    )  # fmt: skip


def test_a_node_that_fails_before_the_first_token_is_retried_elsewhere_once(
    fleet, request: pytest.FixtureRequest
) -> None:
    # A record that looks best (all free, huge pool) but whose address refuses connections.
    async def publish_dead() -> None:
        client = aioredis.Redis.from_url(REDIS_URL)
        try:
            record = CapacityRecord(
                "node-0-dead", f"http://127.0.0.1:{free_port()}", "mixed", ("smollm2",), 100_000, 100_000,
                16, "fp32", 0, 0, 0.0, time.time(), 30.0, "fp32",
            )  # fmt: skip
            await RedisCapacityRegistry(client, fleet.prefix).publish(record)
        finally:
            await client.aclose()

    async def remove_dead() -> None:
        client = aioredis.Redis.from_url(REDIS_URL)
        try:
            await RedisCapacityRegistry(client, fleet.prefix).remove("node-0-dead")
        finally:
            await client.aclose()

    asyncio.run(publish_dead())
    request.addfinalizer(lambda: (asyncio.run(remove_dead()), time.sleep(HEARTBEAT_S)))
    time.sleep(HEARTBEAT_S)
    after, after_wall = time.monotonic(), time.time()

    async def one() -> httpx.Response:
        async with httpx.AsyncClient(timeout=60) as client:
            return await chat(client, fleet, 0)

    response = asyncio.run(one())
    assert response.status_code == 200
    first, retry = fleet.placements(since=after)
    assert first == "node-0-dead"
    assert retry in ("node-a", "node-b")
    assert [e.node_id for e in fleet.events() if e.started_at >= after_wall] == [retry]


def test_a_whole_answer_whose_node_dies_midway_is_answered_by_the_other_node(
    fleet, node_a_back_after
) -> None:
    """Nothing of a whole (non-streamed) answer reaches its client before its end, so a
    node SIGKILLed midway costs the client nothing: the other node answers it whole, and
    the usage event is the one of that answer. The reset marks node-a down at once."""
    reference = asyncio.run(counting_answer(fleet))  # greedy: the same text on either node
    assert reference.status_code == 200
    (record_b,) = [r for r in fleet.records() if r.node_id == "node-b"]
    hold_on(fleet, "node-b", record_b.num_total_tokens)  # node-a scores higher
    try:
        after, after_wall = time.monotonic(), time.time()
        deadline = after + 30
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answering = pool.submit(lambda: asyncio.run(counting_answer(fleet)))
            while not fleet.placements(since=after):
                assert time.monotonic() < deadline, "the request was never placed"
                time.sleep(0.01)
            if fleet.placements(since=after)[0] != "node-a":
                pytest.skip("a lapsed heartbeat hid node-a from the gateway")
            hold_on(fleet, "node-b", None)
            time.sleep(1.0)  # its first tokens are out: 120 of them take far longer
            fleet.node_a.send_signal(signal.SIGKILL)
            response = answering.result(timeout=120)
    finally:
        hold_on(fleet, "node-b", None)
    fleet.node_a.wait(timeout=10)
    assert response.status_code == 200, response.text
    assert response.json()["choices"] == reference.json()["choices"]
    assert fleet.placements(since=after) == ["node-a", "node-b"]
    (event,) = [e for e in fleet.events() if e.started_at >= after_wall]
    assert (event.node_id, event.status) == ("node-b", "ok")
    assert event.output_tokens == response.json()["usage"]["completion_tokens"]
    # Distrusted before its TTL: the next requests go to node-b without a failed try.
    since = time.monotonic()
    assert [r.status_code for r in asyncio.run(burst(fleet, 2))] == [200, 200]
    assert fleet.placements(since=since) == ["node-b", "node-b"]


async def counting_answer(fleet: Fleet) -> httpx.Response:
    async with httpx.AsyncClient(timeout=120) as client:
        return await client.post(
            f"{fleet.gateways[0].url}/v1/completions",
            json={"model": SMOLLM2, "prompt": COUNTING, "max_tokens": 120, "temperature": 0},
            headers={"authorization": f"Bearer {fleet.api_key}"},
        )
