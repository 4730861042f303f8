"""Faults on a real fleet on loopback, and what each costs the clients and the ledger.

    .venv/bin/python benchmarks/fault_suite.py [--out FILE.json]    # the full suite, ~2 min
    .venv/bin/python benchmarks/fault_suite.py --smoke              # seconds: what CI runs

The suite starts its own fleet, every process in a process group of its own: a
redis-server (AOF, fsync on every write) on a free port, a PostgreSQL database it creates
and drops (DATABASE_URL's server), `edgeserve node` x2 (SmolLM2 on the CPU), `edgeserve
gateway` x2 (each its own EDGESERVE_HOME, so its own journal) and one `edgeserve billing
worker`. Four clients send a bounded mix of requests (streamed and whole, OpenAI
completions and chat, some streams left after a few chunks) while one fault per phase
strikes and is mended:

    node SIGKILL     the busiest node killed, restarted on its port past its record's TTL
    node SIGSTOP     the busiest node frozen past the gateways' silence watch (5 s + 5 s)
    worker SIGKILL   the billing worker killed, restarted under the same consumer name
    gateway SIGKILL  gateway-0 killed mid-stream, restarted on its port and journal
    Redis SIGKILL    Redis killed for 10 s, restarted from its AOF

Then it waits for the worker to drain (and for the orphan grace), reads the ledger, and
judges every request by what its client saw:

    lost         the client read a token or a whole answer, and the ledger has no row
    double       a row bills more output than the node could produce (max_tokens), or a
                 billed row of a request whose client got nothing (an error, no answer,
                 or an id no client saw)
    mismatched   a whole answer (body, or a stream to [DONE]) billed other than `ok` with
                 the usage its client read
    over/under   billed output minus the text chunks its client read, for the streams cut
                 short (each chunk carries at least one token, so over-billed is an upper
                 bound on what is billed unread)
    free         tokens clients read of answers that failed on our side (`error`, billed
                 nothing by policy)

and runs `edgeserve billing reconcile` with every journal. Exit 1 on anything lost,
double or mismatched, or a reconcile that fails. `--smoke` runs one node, one gateway,
one worker and one fault (the gateway SIGKILL mid-stream). Figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import platform
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import psycopg
import redis
import redis.asyncio as aioredis

from billing.events import UsageEvent
from billing.journal import Journal
from billing.ledger import BILLED_STATUSES, Ledger, open_ledger
from gateway.keys import RedisKeyStore
from scheduler.capacity import RedisCapacityRegistry

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
EDGESERVE = [sys.executable, "-m", "edgeserve"]
MODEL = "@cf/huggingface/smollm2-135m-instruct"
ACCOUNT_ID = "acct-faults"
API_KEY = "es-fault-suite-" + uuid.uuid4().hex
INTERNAL_TOKEN = "fault-suite-internal-" + uuid.uuid4().hex[:16]
ORPHAN_GRACE_S = 2.0
NODE_START_S = 240.0  # loading SmolLM2 on 2 busy cores
GATEWAY_START_S = 60.0


# -- processes ------------------------------------------------------------------------


class Proc:
    """One child process, leader of a process group of its own (signals reach the group)."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str]) -> None:
        self.name, self.argv, self.log, self.env = name, argv, log, env
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.popen = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, env=os.environ | self.env,
                start_new_session=True,
            )  # fmt: skip

    @property
    def is_alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def send(self, sig: signal.Signals) -> None:
        if self.is_alive:
            assert self.popen is not None
            os.killpg(self.popen.pid, sig)

    def kill(self) -> None:
        self.send(signal.SIGKILL)
        if self.popen is not None:
            self.popen.wait(timeout=10)

    def stop(self) -> None:
        """SIGTERM (after SIGCONT, should it be frozen), SIGKILL past 20 s."""
        if not self.is_alive:
            return
        assert self.popen is not None
        self.send(signal.SIGCONT)
        self.send(signal.SIGTERM)
        try:
            self.popen.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.kill()

    def tail(self, num_chars: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-num_chars:] if self.log.exists() else ""


def free_port() -> int:
    """A port below the kernel's ephemeral range that nobody listens on (client sockets
    never take it between this check and the server's bind)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 30000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-30000")


class Fleet:
    """Redis, a database, nodes, gateways and a worker, all of this run's own."""

    def __init__(self, work: Path, num_nodes: int, num_gateways: int) -> None:
        self.work = work
        self.prefix = f"faults-{uuid.uuid4().hex[:8]}:"
        self.stream = f"{self.prefix}usage"
        self.redis_port = free_port()
        self.redis_url = f"redis://127.0.0.1:{self.redis_port}/0"
        self.database = f"edgeserve_faults_{uuid.uuid4().hex[:12]}"
        # A URL (not libpq's key=value form): open_ledger takes anything else for a file.
        self.database_url = urlsplit(DATABASE_URL)._replace(path=f"/{self.database}").geturl()
        self.is_database_created = False
        (work / "redis").mkdir()
        server = shutil.which("redis-server")
        if server is None:
            raise RuntimeError("redis-server is not installed")
        self.redis = Proc("redis", [
            server, "--bind", "127.0.0.1", "--port", str(self.redis_port), "--save", "",
            "--appendonly", "yes", "--appendfsync", "always", "--dir", str(work / "redis"),
        ], work / "redis.log", {})  # fmt: skip
        self.node_ids = [f"node-{i}" for i in range(num_nodes)]
        self.nodes = [self._node(i) for i in range(num_nodes)]
        self.gateway_ports = [free_port() for _ in range(num_gateways)]
        self.gateways = [self._gateway(i) for i in range(num_gateways)]
        self.worker = Proc("worker", [
            *EDGESERVE, "billing", "worker", "--redis-url", self.redis_url,
            "--stream", self.stream, "--database-url", self.database_url,
            "--consumer", "fault-suite", "--orphan-grace-s", str(ORPHAN_GRACE_S),
            "--claim-interval-s", "1", "--claim-idle-ms", "5000",
        ], work / "worker.log", {})  # fmt: skip

    def _home(self, name: str) -> Path:
        """An EDGESERVE_HOME of the process's own (its usage journal), the models shared."""
        home = self.work / name
        home.mkdir()
        models = Path.home() / ".cache" / "edgeserve" / "models"
        configured = os.environ.get("EDGESERVE_HOME")
        if configured:
            models = Path(configured).expanduser() / "models"
        (home / "models").symlink_to(models)
        return home

    def _node(self, i: int) -> Proc:
        port = free_port()
        return Proc(self.node_ids[i], [
            *EDGESERVE, "node", "--port", str(port), "--node-id", self.node_ids[i],
            "--redis-url", self.redis_url, "--prefix", self.prefix,
            "--internal-token", INTERNAL_TOKEN, "--heartbeat-s", "0.2", "--ttl-s", "3",
            "--max-model-len", "1024", "--kv-memory-mb", "48",
        ], self.work / f"{self.node_ids[i]}.log",
            # One thread a node: two nodes share two cores with the rest of the fleet.
            {"EDGESERVE_HOME": str(self._home(self.node_ids[i])), "OMP_NUM_THREADS": "1"},
        )  # fmt: skip

    def _gateway(self, i: int) -> Proc:
        return Proc(f"gateway-{i}", [
            *EDGESERVE, "gateway", "--port", str(self.gateway_ports[i]),
            "--redis-url", self.redis_url, "--prefix", self.prefix,
            "--internal-token", INTERNAL_TOKEN, "--database-url", self.database_url,
        ], self.work / f"gateway-{i}.log",
            {"EDGESERVE_HOME": str(self._home(f"gateway-{i}"))},
        )  # fmt: skip

    @property
    def gateway_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.gateway_ports]

    def processes(self) -> list[Proc]:
        return [*self.gateways, self.worker, *self.nodes, self.redis]

    def journals(self) -> list[Path]:
        return sorted(self.work.glob("*/journal/*.log"))

    async def start(self) -> None:
        self.start_redis()
        with psycopg.connect(DATABASE_URL, autocommit=True) as admin:
            admin.execute(f'CREATE DATABASE "{self.database}"')
        self.is_database_created = True
        client = aioredis.Redis.from_url(self.redis_url)
        try:
            await RedisKeyStore(client, self.prefix).add(API_KEY, ACCOUNT_ID)
        finally:
            await client.aclose()
        # Limits far above the load: a 429 here would be the suite's, not a fault's.
        subprocess.run([
            *EDGESERVE, "limits", "set", "--account", ACCOUNT_ID, "--rpm", "100000",
            "--tpm", "100000000", "--concurrency", "256", "--redis-url", self.redis_url,
            "--prefix", self.prefix.rstrip(":"),
        ], check=True, capture_output=True, timeout=60)  # fmt: skip
        started_at = time.time()
        for node in self.nodes:
            node.start()
        for gateway in self.gateways:
            gateway.start()
        self.worker.start()
        await asyncio.gather(
            *(self.wait_node(i, started_at) for i in range(len(self.nodes))),
            *(self.wait_gateway(i) for i in range(len(self.gateways))),
        )

    def start_redis(self) -> None:
        self.redis.start()
        deadline = time.monotonic() + 30
        client = redis.Redis.from_url(self.redis_url, socket_timeout=0.5)
        try:
            while True:
                try:
                    client.ping()
                    return
                except redis.RedisError:
                    if not self.redis.is_alive or time.monotonic() > deadline:
                        raise RuntimeError(f"redis did not start:\n{self.redis.tail()}") from None
                    time.sleep(0.05)
        finally:
            client.close()

    async def wait_node(self, i: int, since: float) -> None:
        """Until node i has published a capacity record after `since` (epoch seconds)."""
        deadline = time.monotonic() + NODE_START_S
        while True:
            if not self.nodes[i].is_alive:
                raise RuntimeError(f"{self.node_ids[i]} exited:\n{self.nodes[i].tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.node_ids[i]} never came up:\n{self.nodes[i].tail()}")
            with contextlib.suppress(redis.RedisError, OSError):
                if await self._published_after(self.node_ids[i], since):
                    return
            await asyncio.sleep(0.2)

    async def _published_after(self, node_id: str, since: float) -> bool:
        client = aioredis.Redis.from_url(self.redis_url, socket_timeout=1.0)
        try:
            records = await RedisCapacityRegistry(client, self.prefix).list_live()
        finally:
            await client.aclose()
        return any(r.node_id == node_id and r.published_at > since for r in records)

    async def busiest_node(self, timeout_s: float) -> int:
        """The node running the most requests, once one runs two (or `timeout_s` passed):
        a fault that strikes an idle node shows nothing."""
        deadline = time.monotonic() + timeout_s
        while True:
            running = {node_id: 0 for node_id in self.node_ids}
            client = aioredis.Redis.from_url(self.redis_url, socket_timeout=1.0)
            try:
                for record in await RedisCapacityRegistry(client, self.prefix).list_live():
                    running[record.node_id] = record.num_running
            finally:
                await client.aclose()
            busiest = max(running, key=lambda node_id: running[node_id])
            if running[busiest] >= 2 or time.monotonic() > deadline:
                return self.node_ids.index(busiest)
            await asyncio.sleep(0.05)

    async def wait_gateway(self, i: int) -> None:
        deadline = time.monotonic() + GATEWAY_START_S
        async with httpx.AsyncClient(timeout=1.0) as http:
            while True:
                if not self.gateways[i].is_alive:
                    raise RuntimeError(f"gateway-{i} exited:\n{self.gateways[i].tail()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"gateway-{i} never became ready")
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(f"{self.gateway_urls[i]}/healthz")).status_code == 200:
                        return
                await asyncio.sleep(0.1)

    def close(self) -> None:
        for proc in self.processes():
            with contextlib.suppress(Exception):
                proc.stop()
        if self.is_database_created:
            with psycopg.connect(DATABASE_URL, autocommit=True) as admin:
                admin.execute(f'DROP DATABASE IF EXISTS "{self.database}" WITH (FORCE)')


# -- load -----------------------------------------------------------------------------


@dataclass
class Outcome:
    """One request as its client saw it (and, once judged, its ledger row)."""

    phase: str
    gateway: int
    kind: str  # stream | chat-stream | leaver | whole | chat-whole
    max_tokens: int
    sent_at: float  # epoch seconds
    ended_at: float = 0.0
    status: int | None = None  # None: no status line came (refused, reset)
    request_id: str = ""
    num_chunks: int = 0  # chunks with text the client read
    is_done: bool = False  # a whole body, or a stream to [DONE]
    usage_output: int | None = None  # completion_tokens the answer reported
    is_left: bool = False  # the client left on purpose
    error: str = ""
    row: dict[str, Any] | None = None

    @property
    def got_something(self) -> bool:
        return self.num_chunks > 0 or (self.status is not None and 200 <= self.status < 300)

    @property
    def got_output(self) -> bool:
        """A token, or a whole answer: a stream whose gateway died after its status line and
        before its start record is billed nothing (docs/billing.md), nothing read either."""
        return self.num_chunks > 0 or self.is_done


class Load:
    """Clients that send requests back to back until told to stop (or a deadline)."""

    def __init__(self, urls: list[str], kinds: list[str], seed: int, phase: str) -> None:
        self.urls = urls
        self.kinds = kinds
        self.rng = random.Random(seed)
        self.phase = phase
        self.outcomes: list[Outcome] = []
        # Streams mid-answer (a token read, no end yet) per gateway: where a kill bites.
        self.streaming: list[set[int]] = [set() for _ in urls]
        self.stop = asyncio.Event()

    async def client(self, i: int, deadline: float) -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=2.0)) as http:
            n = i
            while not self.stop.is_set() and time.monotonic() < deadline:
                outcome = Outcome(self.phase, n % len(self.urls), self.rng.choice(self.kinds),
                                  0, time.time())  # fmt: skip
                n += 1
                self.outcomes.append(outcome)
                await self._one(http, outcome)
                outcome.ended_at = time.time()
                if outcome.status is None:
                    await asyncio.sleep(0.2)  # a gateway down: no tight loop of refusals

    async def _one(self, http: httpx.AsyncClient, o: Outcome) -> None:
        is_chat = o.kind.startswith("chat")
        is_stream = o.kind.endswith("stream") or o.kind == "leaver"
        o.max_tokens = self.rng.randint(24, 48) if is_stream else self.rng.randint(6, 16)
        leave_after = self.rng.randint(2, 5) if o.kind == "leaver" else 0
        start = self.rng.randint(1, 500)
        body: dict[str, Any] = {"model": MODEL, "max_tokens": o.max_tokens, "temperature": 0}
        if is_chat:
            body["messages"] = [{"role": "user", "content": f"Count from {start} upwards."}]
        else:
            body["prompt"] = f"Count from {start} upwards, one number a line:"
        if is_stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        url = self.urls[o.gateway] + ("/v1/chat/completions" if is_chat else "/v1/completions")
        headers = {"authorization": f"Bearer {API_KEY}"}
        try:
            if is_stream:
                await self._stream(http, url, body, headers, o, leave_after)
            else:
                # The status line and request id as they arrive, before the body: a gateway
                # that dies between them has sent a bill's id its client holds.
                async with http.stream("POST", url, json=body, headers=headers) as response:
                    o.status = response.status_code
                    o.request_id = response.headers.get("x-request-id", "")
                    data = await response.aread()
                if response.status_code == 200:
                    o.usage_output = int(json.loads(data)["usage"]["completion_tokens"])
                    o.is_done = True
                else:
                    o.error = data.decode(errors="replace")[:160]
        except httpx.ConnectError:
            o.error = "refused"
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            o.error = type(exc).__name__
        finally:
            self.streaming[o.gateway].discard(id(o))

    async def _stream(
        self, http: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str],
        o: Outcome, leave_after: int,
    ) -> None:  # fmt: skip
        async with http.stream("POST", url, json=body, headers=headers) as response:
            o.status, o.request_id = response.status_code, response.headers.get("x-request-id", "")
            if response.status_code != 200:
                o.error = (await response.aread()).decode(errors="replace")[:160]
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    o.is_done = True
                    return
                event = json.loads(line[6:])
                if "error" in event:
                    o.error = str(event["error"].get("code"))
                    continue
                if event.get("usage"):
                    o.usage_output = int(event["usage"]["completion_tokens"])
                for choice in event.get("choices", ()):
                    if choice.get("text") or (choice.get("delta") or {}).get("content"):
                        o.num_chunks += 1
                        self.streaming[o.gateway].add(id(o))
                if leave_after and o.num_chunks >= leave_after:
                    o.is_left = True
                    return  # leaving the block closes the connection mid-stream

    async def until_streaming(self, gateway: int, count: int, timeout_s: float) -> int:
        """Waits until `count` streams on `gateway` are mid-answer (at most `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while len(self.streaming[gateway]) < count and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return len(self.streaming[gateway])


# -- faults ---------------------------------------------------------------------------


# Strikes, waits, mends; returns once the fleet is whole again.
Fault = Callable[[Fleet, Load], Awaitable[None]]


@dataclass
class Phase:
    name: str
    fault: Fault
    started_at: float = 0.0
    fault_at: float = 0.0
    mended_at: float = 0.0
    ended_at: float = 0.0


async def no_fault(fleet: Fleet, load: Load) -> None:
    await asyncio.sleep(4.0)


async def node_sigkill(fleet: Fleet, load: Load) -> None:
    i = await fleet.busiest_node(timeout_s=15.0)
    fleet.nodes[i].kill()
    await asyncio.sleep(4.0)  # past its record's TTL (3 s): the gateways see it gone
    restarted_at = time.time()
    fleet.nodes[i].start()
    await fleet.wait_node(i, restarted_at)


async def node_sigstop(fleet: Fleet, load: Load) -> None:
    i = await fleet.busiest_node(timeout_s=15.0)
    fleet.nodes[i].send(signal.SIGSTOP)
    await asyncio.sleep(12.0)  # past the silence watch: 5 s silent, 5 s for the probe
    resumed_at = time.time()
    fleet.nodes[i].send(signal.SIGCONT)
    await fleet.wait_node(i, resumed_at)


async def worker_sigkill(fleet: Fleet, load: Load) -> None:
    fleet.worker.kill()
    await asyncio.sleep(4.0)
    fleet.worker.start()


async def gateway_sigkill(fleet: Fleet, load: Load) -> None:
    await load.until_streaming(0, 2, timeout_s=20.0)
    fleet.gateways[0].kill()
    await asyncio.sleep(2.0)
    fleet.gateways[0].start()
    await fleet.wait_gateway(0)


async def redis_sigkill(fleet: Fleet, load: Load) -> None:
    fleet.redis.kill()
    await asyncio.sleep(10.0)  # the outage
    await asyncio.to_thread(fleet.start_redis)  # from its AOF, on its port
    mended_at = time.time()
    await asyncio.gather(*(fleet.wait_node(i, mended_at) for i in range(len(fleet.nodes))))


FULL: list[tuple[str, Fault]] = [
    ("calm", no_fault),
    ("node SIGKILL", node_sigkill),
    ("node SIGSTOP", node_sigstop),
    ("worker SIGKILL", worker_sigkill),
    ("gateway SIGKILL", gateway_sigkill),
    ("Redis SIGKILL", redis_sigkill),
]
SMOKE: list[tuple[str, Fault]] = [("gateway SIGKILL", gateway_sigkill)]


async def run_phases(fleet: Fleet, load: Load, phases: list[Phase], lead_s: float) -> None:
    for phase in phases:
        load.phase = phase.name
        phase.started_at = time.time()
        await asyncio.sleep(lead_s)
        phase.fault_at = time.time()
        await phase.fault(fleet, load)
        phase.mended_at = time.time()
        await asyncio.sleep(lead_s)
        phase.ended_at = time.time()
        print(f"  {phase.name}: fault held {phase.mended_at - phase.fault_at:.1f} s "
              f"(phase {phase.ended_at - phase.started_at:.1f} s)", flush=True)  # fmt: skip


# -- judging --------------------------------------------------------------------------


@dataclass
class Figures:
    sent: int = 0
    ok: int = 0  # 2xx
    client_errors: int = 0  # 4xx but 429
    rate_limited: int = 0  # 429
    server_errors: int = 0  # 5xx
    server_errors_in_fault: int = 0  # 5xx of requests sent while the fault held
    refused: int = 0  # the connection refused: nothing sent
    no_answer: int = 0  # sent, and the connection broke before a status line
    cut: int = 0  # 2xx streams that ended without [DONE], not by their client
    left: int = 0  # streams their client left on purpose
    max_seconds: float = 0.0  # the longest request, sent to its end
    lost: int = 0
    double: int = 0
    mismatched: int = 0
    over_billed_tokens: int = 0
    over_billed_requests: int = 0
    max_over_billed: int = 0
    under_billed_tokens: int = 0
    under_billed_requests: int = 0
    free_tokens: int = 0  # read by clients of answers that failed on our side
    unseen_rows: int = 0  # ledger rows of request ids no client saw
    unseen_billed: int = 0


# What the raw figures keep of a request's ledger row.
ROW_FIELDS = ("node_id", "status", "input_tokens", "output_tokens", "cached_tokens")


def judge(o: Outcome, row: UsageEvent | None, f: Figures, in_fault: bool) -> None:
    f.sent += 1
    f.max_seconds = max(f.max_seconds, round(o.ended_at - o.sent_at, 1))
    if o.error == "refused":
        f.refused += 1
    elif o.status is None:
        f.no_answer += 1
    elif o.status == 429:
        f.rate_limited += 1
    elif 400 <= o.status < 500:
        f.client_errors += 1
    elif o.status >= 500:
        f.server_errors += 1
        f.server_errors_in_fault += in_fault
    else:
        f.ok += 1
        if not o.is_done:
            f.left += o.is_left
            f.cut += not o.is_left
    is_billed = row is not None and row.status in BILLED_STATUSES
    if row is not None:
        o.row = {name: getattr(row, name) for name in ROW_FIELDS}
    if o.got_output and row is None:
        f.lost += 1
    # More than the node could produce, or billed for nothing the client got.
    if (row is not None and row.output_tokens > o.max_tokens) or (
        is_billed and not o.got_something
    ):
        f.double += 1
    if row is None or not o.got_something:
        return
    if o.is_done and o.usage_output is not None:
        if row.status != "ok" or row.output_tokens != o.usage_output:
            f.mismatched += 1
        return
    if not is_billed:  # failed on our side: what the client read is free
        f.free_tokens += o.num_chunks
        return
    over, under = row.output_tokens - o.num_chunks, o.num_chunks - row.output_tokens
    if over > 0:
        f.over_billed_tokens += over
        f.over_billed_requests += 1
        f.max_over_billed = max(f.max_over_billed, over)
    if under > 0:
        f.under_billed_tokens += under
        f.under_billed_requests += 1


def judge_unseen(row: UsageEvent, f: Figures, max_tokens: int) -> None:
    """A ledger row no client knows the id of: its client got no status line."""
    f.unseen_rows += 1
    if row.status in BILLED_STATUSES:
        f.unseen_billed += 1
        f.double += 1
    elif row.output_tokens > max_tokens:
        f.double += 1


def phase_of(when: float, phases: list[Phase]) -> Phase:
    return next((p for p in reversed(phases) if when >= p.started_at), phases[0])


# -- draining and reconciling ---------------------------------------------------------


def is_drained(fleet: Fleet, ledger: Ledger, expected: list[str]) -> bool:
    """The stream read and acknowledged, the journals replayed, no stream's start open,
    every request a client read output of billed."""
    if any(not Journal(path).is_empty() for path in fleet.journals()):
        return False
    client = redis.Redis.from_url(fleet.redis_url, socket_timeout=2.0)
    try:
        last = client.xinfo_stream(fleet.stream)["last-generated-id"]
        (group,) = client.xinfo_groups(fleet.stream)
        if group["pending"] or group["last-delivered-id"] != last:
            return False
    except (redis.RedisError, ValueError):
        return False
    finally:
        client.close()
    if any(started is not None for started, _ in ledger.open_requests().values()):
        return False
    return not ledger.missing(expected)


def reconcile(fleet: Fleet) -> tuple[int, dict[str, Any]]:
    journals = [arg for path in fleet.journals() for arg in ("--journal", str(path))]
    done = subprocess.run([
        *EDGESERVE, "billing", "reconcile", "--redis-url", fleet.redis_url,
        "--stream", fleet.stream, "--database-url", fleet.database_url, "--json", *journals,
    ], capture_output=True, text=True, timeout=120)  # fmt: skip
    try:
        report = json.loads(done.stdout)
    except ValueError:
        report = {"output": (done.stdout + done.stderr)[-2000:]}
    return done.returncode, report


# -- the run --------------------------------------------------------------------------


@dataclass
class Config:
    smoke: bool
    num_clients: int
    kinds: list[str]
    lead_s: float
    drain_s: float
    deadline_s: float
    seed: int
    out: Path | None
    faults: list[tuple[str, Fault]]


def config(args: argparse.Namespace) -> Config:
    if args.smoke:
        return Config(True, 3, ["stream", "chat-stream", "whole"], 2.0, 60.0, 300.0,
                      args.seed, args.out, SMOKE)  # fmt: skip
    kinds = ["stream", "chat-stream", "leaver", "whole", "chat-whole"]
    return Config(False, 4, kinds, 3.0, 90.0, 900.0, args.seed, args.out, FULL)


async def run(cfg: Config, fleet: Fleet) -> dict[str, Any]:
    print(f"starting the fleet in {fleet.work} ...", flush=True)
    began = time.monotonic()
    await fleet.start()
    print(f"  ready in {time.monotonic() - began:.1f} s", flush=True)
    phases = [Phase(name, fault) for name, fault in cfg.faults]
    load = Load(fleet.gateway_urls, cfg.kinds, cfg.seed, phases[0].name)
    deadline = time.monotonic() + cfg.deadline_s
    clients = [asyncio.ensure_future(load.client(i, deadline)) for i in range(cfg.num_clients)]
    try:
        await asyncio.wait_for(run_phases(fleet, load, phases, cfg.lead_s), cfg.deadline_s)
    finally:
        load.stop.set()
        _, running = await asyncio.wait(clients, timeout=90)
        for task in running:
            task.cancel()
    ledger = open_ledger(fleet.database_url)
    try:
        expected = [o.request_id for o in load.outcomes if o.got_output and o.request_id]
        drain_deadline = time.monotonic() + cfg.drain_s
        drain_began = time.monotonic()
        while not is_drained(fleet, ledger, expected) and time.monotonic() < drain_deadline:
            await asyncio.sleep(0.5)
        print(f"  billing drained in {time.monotonic() - drain_began:.1f} s", flush=True)
        await asyncio.sleep(ORPHAN_GRACE_S + 1.0)  # a start still unannounced gets its turn
        rows = ledger.rows(ledger.ended_since(0.0))
        open_left = ledger.open_requests()
    finally:
        ledger.close()
    exit_code, report = reconcile(fleet)
    return summarize(cfg, fleet, load, phases, rows, open_left, exit_code, report)


def summarize(
    cfg: Config, fleet: Fleet, load: Load, phases: list[Phase],
    rows: dict[str, UsageEvent | None], open_left: dict[str, Any], exit_code: int,
    report: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    per_phase = {p.name: Figures() for p in phases}
    overall = Figures()
    seen = set()
    for o in load.outcomes:
        row = rows.get(o.request_id) if o.request_id else None
        seen.add(o.request_id)
        phase = next(p for p in phases if p.name == o.phase)
        in_fault = phase.fault_at <= o.sent_at <= phase.mended_at
        judge(o, row, per_phase[o.phase], in_fault)
        judge(o, row, overall, in_fault)
    max_tokens = max((o.max_tokens for o in load.outcomes), default=0)
    for request_id, row in rows.items():
        if request_id not in seen and row is not None:
            judge_unseen(row, per_phase[phase_of(row.started_at, phases).name], max_tokens)
            judge_unseen(row, overall, max_tokens)
    is_failed = bool(overall.lost or overall.double or overall.mismatched or exit_code)
    return {
        "command": " ".join(["benchmarks/fault_suite.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": f"{cpu_name()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, load average {os.getloadavg()[0]:.2f} at the end",
        "mode": "smoke" if cfg.smoke else "full",
        "fleet": {
            "nodes": len(fleet.nodes),
            "gateways": len(fleet.gateways),
            "workers": 1,
            "clients": cfg.num_clients,
            "kinds": cfg.kinds,
        },
        "phases": [
            {
                "name": p.name,
                "seconds": round(p.ended_at - p.started_at, 1),
                "fault_at": p.fault_at,
                "mended_at": p.mended_at,
                "fault_seconds": round(p.mended_at - p.fault_at, 1),
                "figures": dataclasses.asdict(per_phase[p.name]),
            }
            for p in phases
        ],
        "overall": dataclasses.asdict(overall),
        "lost": overall.lost,
        "double": overall.double,
        "mismatched": overall.mismatched,
        "open_requests_left": len(open_left),
        # Usage events written to a journal while Redis is away, per process.
        "journaled": {
            proc.name: proc.tail(10**8).count("journaling")
            for proc in [*fleet.gateways, *fleet.nodes]
        },
        "reconcile": {"exit_code": exit_code, "report": report},
        "failed": is_failed,
        "requests": [dataclasses.asdict(o) for o in load.outcomes],
    }


TRAFFIC = [("sent", "sent"), ("2xx", "ok"), ("4xx", "client_errors"), ("429", "rate_limited"),
           ("5xx", "server_errors"), ("5xx in fault", "server_errors_in_fault"),
           ("refused", "refused"), ("no answer", "no_answer"), ("cut", "cut"), ("left", "left"),
           ("max s", "max_seconds")]  # fmt: skip
BILLING = [("lost", "lost"), ("double", "double"), ("mismatched", "mismatched"),
           ("over tok", "over_billed_tokens"), ("over req", "over_billed_requests"),
           ("max over", "max_over_billed"), ("under tok", "under_billed_tokens"),
           ("free tok", "free_tokens"), ("unseen rows", "unseen_rows")]  # fmt: skip


def table(result: dict[str, Any], columns: list[tuple[str, str]]) -> Iterator[str]:
    named = [(p["name"], p["figures"]) for p in result["phases"]]
    if len(named) > 1:
        named.append(("all", result["overall"]))
    width = max(len(name) for name, _ in named)
    yield " | ".join(["phase".ljust(width), *(title for title, _ in columns)])
    yield "-|-".join(["-" * width, *("-" * len(title) for title, _ in columns)])
    for name, figures in named:
        cells = [str(figures[key]).rjust(len(title)) for title, key in columns]
        yield " | ".join([name.ljust(width), *cells])


def report_text(result: dict[str, Any]) -> str:
    lines = [f"{result['command']} ({result['mode']}), {result['date']}", result["machine"],
             json.dumps(result["fleet"]), ""]  # fmt: skip
    lines += [f"{p['name']}: {p['seconds']} s, fault held {p['fault_seconds']} s"
              for p in result["phases"]]  # fmt: skip
    lines += ["", "requests by the phase they are sent in:", *table(result, TRAFFIC)]
    lines += ["", "billing (tokens: output billed vs text chunks read):", *table(result, BILLING)]
    rec = result["reconcile"]
    lines += ["", f"usage events journaled while Redis is away: {result['journaled']}"]
    lines += [f"reconcile: exit {rec['exit_code']}; open requests left in the ledger: "
              f"{result['open_requests_left']}"]  # fmt: skip
    lines.append("FAILED" if result["failed"] else "OK: nothing lost, nothing billed twice")
    return "\n".join(lines)


def write_json(path: Path, result: dict[str, Any]) -> None:
    """The figures indented, the requests one a line."""
    head = json.dumps({k: v for k, v in result.items() if k != "requests"}, indent=1)
    requests = ",\n".join("  " + json.dumps(r) for r in result["requests"])
    path.write_text(f'{head[:-2]},\n "requests": [\n{requests}\n ]\n}}\n')


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="one fault, a few requests")
    parser.add_argument("--out", type=Path, help="write the raw figures here (JSON)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keep", action="store_true", help="keep the logs' directory")
    args = parser.parse_args()
    cfg = config(args)
    work = Path(tempfile.mkdtemp(prefix="edgeserve-faults-"))
    n = 1 if cfg.smoke else 2
    fleet = Fleet(work, num_nodes=n, num_gateways=n)
    try:
        result = asyncio.run(run(cfg, fleet))
    except BaseException:
        for proc in fleet.processes():
            print(f"--- {proc.name} (last lines)\n{proc.tail()}", file=sys.stderr)
        raise
    finally:
        fleet.close()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(report_text(result))
    if cfg.out is not None:
        write_json(cfg.out, result)
    if result["failed"]:
        print(json.dumps(result["reconcile"]["report"], indent=1), file=sys.stderr)
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
