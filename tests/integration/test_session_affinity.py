"""`x-session-affinity` across a fleet: two gateways, two SmolLM2 nodes, one Redis.

Both gateways are wired as `edgeserve gateway` wires them (gateway/stores.py), so they
share capacity, reservations and affinities through Redis; the nodes are two engines on
the same weights, each with a KV pool of its own. Where each request ran is read from
its usage event.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio as aioredis

from gateway.admission import AdmissionSettings
from gateway.app import create_app
from gateway.keys import RedisKeyStore
from gateway.settings import GatewaySettings
from gateway.stores import redis_stores
from gpu_node.server import NodeService, NodeSettings, create_node_app
from scheduler.capacity import RedisCapacityRegistry
from scheduler.placement import Candidate, Placement, Placer, RedisReservations
from tests.conftest import (
    ACCOUNT_ID,
    INTERNAL_TOKEN,
    REDIS_URL,
    SMOLLM2,
    ListSink,
    ServerThread,
    free_port,
)

HEARTBEAT_S = 0.2


@dataclass
class Fleet:
    gateways: list[ServerThread]
    sinks: list[ListSink]
    api_key: str
    prefix: str

    def node_of(self, response: httpx.Response) -> str:
        """The node that ran the request `response` answers, from its usage event (recorded
        before a whole answer goes out)."""
        assert response.status_code == 200, response.text
        request_id = response.headers["x-request-id"]
        (event,) = [e for sink in self.sinks for e in sink.events if e.request_id == request_id]
        return str(event.node_id)


def live_nodes(prefix: str) -> dict[str, int]:
    """The live nodes and their KV tokens."""

    async def read() -> dict[str, int]:
        client = aioredis.Redis.from_url(REDIS_URL)
        try:
            records = await RedisCapacityRegistry(client, prefix).list_live()
        finally:
            await client.aclose()
        return {r.node_id: r.num_total_tokens for r in records}

    return asyncio.run(read())


def hold_on(prefix: str, node_id: str, num_tokens: int | None) -> None:
    """Hold `num_tokens` reserved on a node in the fleet's reservation table, as a request
    would (None: let them go)."""

    async def go() -> None:
        client = aioredis.Redis.from_url(REDIS_URL)
        try:
            reservations = RedisReservations(client, prefix, ttl_s=600.0)  # never renewed
            if num_tokens is None:
                await reservations.release(node_id, "test-hold")
            else:
                unlimited = Candidate(node_id, 0, 2**40, 0)
                assert await reservations.reserve_best("test-hold", num_tokens, [unlimited]) == 0
        finally:
            await client.aclose()

    asyncio.run(go())


async def add_key(prefix: str) -> str:
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        return await RedisKeyStore(client, prefix).create(ACCOUNT_ID)
    finally:
        await client.aclose()


@pytest.fixture(scope="module")
def second_engine(engine: Any) -> Iterator[Any]:
    """A second engine on the same weights, with a KV pool of its own."""
    from gpu_node.engine.async_engine import AsyncEngine
    from gpu_node.engine.llm_engine import LLMEngine

    inner = engine.engine
    second = AsyncEngine(LLMEngine(inner.config, inner.model, inner.tokenizer))
    second.start()
    yield second
    second.shutdown()


def _gateway(prefix: str, sink: ListSink) -> ServerThread:
    client = aioredis.Redis.from_url(REDIS_URL)  # used only by this gateway's event loop
    settings = GatewaySettings(internal_token=INTERNAL_TOKEN, capacity_max_age_s=HEARTBEAT_S)
    stores = redis_stores(
        client, settings, AdmissionSettings(key_prefix=prefix.rstrip(":")), prefix
    )
    app = create_app(
        settings,
        keys=stores.keys,
        placer=stores.placer,
        limiter=stores.limiter,
        usage_sink=sink,
        on_shutdown=client.aclose,
    )
    return ServerThread(app).start()


@pytest.fixture(scope="module")
def fleet(engine: Any, second_engine: Any) -> Iterator[Fleet]:
    prefix = f"test:sessions-{uuid.uuid4().hex[:10]}:"
    nodes = []
    for node_id, node_engine in (("node-a", engine), ("node-b", second_engine)):
        port = free_port()
        service = NodeService(
            NodeSettings(
                node_id, f"http://127.0.0.1:{port}", INTERNAL_TOKEN,
                heartbeat_s=HEARTBEAT_S, ttl_s=30.0,
            ),
            RedisCapacityRegistry(aioredis.Redis.from_url(REDIS_URL), prefix),
            engine=node_engine,
        )  # fmt: skip
        nodes.append(ServerThread(create_node_app(service), port).start())
    sinks = [ListSink(), ListSink()]
    gateways = [_gateway(prefix, sink) for sink in sinks]

    api_key = asyncio.run(add_key(prefix))
    try:
        deadline = time.monotonic() + 30
        while sorted(live_nodes(prefix)) != ["node-a", "node-b"]:
            assert time.monotonic() < deadline, "the nodes never published their capacity"
            time.sleep(0.05)
        yield Fleet(gateways, sinks, api_key, prefix)
    finally:
        for server in [*gateways, *nodes]:
            server.stop()
        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()


def _run(fleet: Fleet, gateway: int, session: str | None, dialect: str = "workers_ai") -> str:
    """One short generation through gateway `gateway`; the node that ran it."""
    headers = {"authorization": f"Bearer {fleet.api_key}"}
    if session is not None:
        headers["x-session-affinity"] = session
    url = fleet.gateways[gateway].url
    if dialect == "workers_ai":
        path = f"{url}/client/v4/accounts/{ACCOUNT_ID}/ai/run/{SMOLLM2}"
        body: dict[str, Any] = {"prompt": "Hi", "max_tokens": 1, "temperature": 0}
    else:
        path = f"{url}/v1/chat/completions"
        body = {"model": SMOLLM2, "messages": [{"role": "user", "content": "Hi"}]}
        body |= {"max_tokens": 1, "temperature": 0}
    return fleet.node_of(httpx.post(path, json=body, headers=headers, timeout=60))


def test_one_session_runs_on_one_node_through_either_gateway(fleet: Fleet) -> None:
    sessions = [f"chat-{i}" for i in range(10)]
    homes = {s: _run(fleet, i % 2, s) for i, s in enumerate(sessions)}
    # different sessions spread over both nodes
    assert set(homes.values()) == {"node-a", "node-b"}, homes
    # Each node in turn has half its KV held (a burst of other work): it scores far below
    # the other, yet its sessions come back to it, through the other gateway, in either
    # dialect, with requests outside any session between them; new sessions go elsewhere.
    nodes = live_nodes(fleet.prefix)
    for held, other in (("node-a", "node-b"), ("node-b", "node-a")):
        hold_on(fleet.prefix, held, nodes[held] // 2)
        try:
            for i, session in enumerate(sessions):
                _run(fleet, i % 2, None)
                assert _run(fleet, (i + 1) % 2, session, "openai") == homes[session], session
                assert _run(fleet, i % 2, session) == homes[session], session
            assert {_run(fleet, i % 2, f"new-{held}-{i}") for i in range(4)} == {other}
        finally:
            hold_on(fleet.prefix, held, None)


class RecordingPlacer(Placer):
    """A real placer that also keeps the session of every placement asked for."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sessions: list[str | None] = []

    async def place(self, *args: Any, **kwargs: Any) -> Placement | None:
        self.sessions.append(kwargs.get("session_id"))
        return await super().place(*args, **kwargs)


def test_every_route_that_places_a_request_carries_its_session() -> None:
    """Generations and embeddings in both dialects hand the header to placement (the node,
    at an address that answers nothing, fails each: placement is what is under test)."""
    from gateway.keys import MemoryKeyStore
    from scheduler.capacity import CapacityRecord, CapacityView, LocalCapacityRegistry
    from scheduler.placement import LocalReservations

    registry = LocalCapacityRegistry()
    record = CapacityRecord(
        node_id="nowhere", address=f"http://127.0.0.1:{free_port()}", role="mixed",
        models=("smollm2", "minilm"), num_pages=64, num_free_pages=64, page_size=16,
        kv_dtype="fp32", num_running=0, num_waiting=0, load=0.0, published_at=time.time(),
        ttl_s=3600.0, activations="fp32", max_request_tokens=1024,
        embedding_models={"minilm": 256},
    )  # fmt: skip
    asyncio.run(registry.publish(record))
    keys = MemoryKeyStore()
    asyncio.run(keys.add("es-session-key", ACCOUNT_ID))
    # a fresh view each placement: a node marked down comes back on its next read
    placer = RecordingPlacer(CapacityView(registry, max_age_s=0.0), LocalReservations())
    app = create_app(GatewaySettings(internal_token=INTERNAL_TOKEN), keys=keys, placer=placer)
    server = ServerThread(app).start()
    account_ai = f"/client/v4/accounts/{ACCOUNT_ID}/ai"
    chat = {"model": SMOLLM2, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    calls = [
        (f"{account_ai}/run/{SMOLLM2}", {"prompt": "Hi", "max_tokens": 1}),
        (f"{account_ai}/run/minilm", {"text": "Hi"}),
        ("/v1/chat/completions", chat),
        ("/v1/completions", {"model": SMOLLM2, "prompt": "Hi", "max_tokens": 1}),
        ("/v1/embeddings", {"model": "minilm", "input": "Hi"}),
    ]
    try:
        for i, (path, body) in enumerate(calls):
            headers = {"authorization": "Bearer es-session-key", "x-session-affinity": f"s{i}"}
            asyncio.run(registry.publish(replace(record, published_at=time.time())))
            response = httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=30)
            assert response.status_code in (502, 503), (path, response.text)
            assert placer.sessions[-1] == f"s{i}", path
        # no header, or a blank one: no session
        for value in (None, ""):
            headers = {"authorization": "Bearer es-session-key"}
            if value is not None:
                headers["x-session-affinity"] = value
            asyncio.run(registry.publish(replace(record, published_at=time.time())))
            httpx.post(f"{server.url}{calls[0][0]}", json=calls[0][1], headers=headers, timeout=30)
            assert placer.sessions[-1] is None
    finally:
        server.stop()
