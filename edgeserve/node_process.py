"""`up`'s node in a process of its own, so that the engine's compute and the gateway's event
loop share neither an interpreter lock nor a process (figures: docs/benchmarks.md, "CPU
against llama.cpp").

The parent binds the node's socket and hands it down, so the port is fixed before anything
loads. It writes the node's spec to the child's stdin and keeps that pipe open: the child
reads end-of-file when its parent is gone, however it went, and stops like on SIGTERM, so
no node outlives its `up`. The child runs in a session of its own: a terminal's ctrl-C
reaches the parent alone, which drains the node with SIGTERM and waits for it.

The parent reads the node's health and capacity record over the node API every heartbeat
and publishes the record where its gateway places requests: the node itself has no registry.

    parent (`up`): gateway ── loopback HTTP ──> child (`python -m edgeserve.node_process`):
                   NodeProcess: health, capacity     node API, engine thread, torch threads
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from edgeserve.threads import thread_environment

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeSpec:
    """What the node process is started with (JSON on its stdin, never in its argv)."""

    node_id: str
    internal_token: str
    engine: dict[str, Any]  # serve._engine_factory's arguments
    limits: dict[str, Any]  # ConnectionLimits' fields
    port: int
    fd: int  # the socket bound to `port`, inherited
    embedding_model: str | None = None
    access_log: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str) -> NodeSpec:
        return cls(**json.loads(raw))

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass(frozen=True)
class _Settings:
    node_id: str


@dataclass
class NodeProcess:
    """The parent's handle on its node process: what `up` waits on and drains, shaped like
    the NodeService it stands for (`settings.node_id`, `registry`, `is_ready`, `load_error`,
    `begin_drain`)."""

    spec: NodeSpec
    registry: Any  # where the node's capacity record is published for the gateway
    heartbeat_s: float = 1.0
    drain_timeout_s: float = 35.0  # the node's own drain (30 s) and its exit
    load_error: str | None = None
    is_draining: bool = False
    has_exited: bool = False  # the node ended on its own after it was ready
    _is_loaded: bool = False
    _proc: subprocess.Popen[bytes] | None = None
    _watch: asyncio.Task[None] | None = None
    _client: Any = None
    settings: _Settings = field(init=False)

    def __post_init__(self) -> None:
        self.settings = _Settings(self.spec.node_id)

    @property
    def is_ready(self) -> bool:
        return self._is_loaded and not self.is_draining and not self.has_exited

    def start(self, on_exit: Any = None) -> None:
        """Starts the node process and the heartbeat that reads it; `on_exit()` runs if the
        node ends on its own once it was ready."""
        import httpx

        self._proc = subprocess.Popen(
            [sys.executable, "-m", "edgeserve.node_process"],
            stdin=subprocess.PIPE, pass_fds=(self.spec.fd,), start_new_session=True,
            env=thread_environment(self.spec.engine.get("device", "cpu")) | os.environ,
        )  # fmt: skip
        assert self._proc.stdin is not None
        self._proc.stdin.write(self.spec.to_json().encode() + b"\n")
        self._proc.stdin.flush()
        self._client = httpx.AsyncClient(
            base_url=self.spec.address,
            headers={"authorization": f"Bearer {self.spec.internal_token}"},
            timeout=5.0,
        )
        self._watch = asyncio.create_task(self._heartbeat(on_exit), name="node-heartbeat")

    async def _heartbeat(self, on_exit: Any) -> None:
        from scheduler.capacity import CapacityRecord

        assert self._proc is not None
        while not self.is_draining:
            if self._proc.poll() is not None:
                if self._is_loaded:
                    self.has_exited = True
                    if on_exit is not None:
                        on_exit(self._proc.returncode)
                else:
                    self.load_error = f"the node process exited with code {self._proc.returncode}"
                return
            try:
                if not self._is_loaded:
                    health = await self._client.get("/internal/v1/health")
                    body = health.json()
                    if body.get("status") == "failed":
                        self.load_error = body.get("error", "unknown")
                        return
                    self._is_loaded = health.status_code == 200
                if self._is_loaded:
                    answer = await self._client.get("/internal/v1/capacity")
                    answer.raise_for_status()
                    record = CapacityRecord.from_json(answer.content)
                    async with asyncio.timeout(5.0):
                        if not self.is_draining:
                            await self.registry.publish(record)
            except Exception as exc:  # the node busy loading, or the store away: next beat
                if self._is_loaded:
                    log.warning("node heartbeat failed: %s", exc)
            await asyncio.sleep(self.heartbeat_s if self._is_loaded else 0.05)

    async def begin_drain(self) -> None:
        """Leave the registry, then drain the node: it refuses new work and finishes what runs."""
        self.is_draining = True
        with contextlib.suppress(Exception):
            async with asyncio.timeout(5.0):
                await self.registry.remove(self.spec.node_id)
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)

    async def stop(self) -> None:
        """Waits for the node to end its drain; kills it past `drain_timeout_s`."""
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        if self._client is not None:
            await self._client.aclose()
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(proc.wait, self.drain_timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait)
        if proc.stdin is not None:
            proc.stdin.close()


def main() -> None:
    """The node process: reads its spec on stdin, serves until SIGTERM or its parent goes."""
    from edgeserve.connections import ConnectionLimits
    from edgeserve.loading import _embedder_factory, _engine_factory, _telemetry
    from edgeserve.servers import run_servers, uvicorn_server

    spec = NodeSpec.from_json(sys.stdin.readline())
    sock = socket.socket(fileno=spec.fd)
    limits = ConnectionLimits(**spec.limits)

    async def serve() -> None:
        from gpu_node.server import NodeService, NodeSettings, create_node_app

        loop = asyncio.get_running_loop()
        stdin = sys.stdin.fileno()

        def on_stdin() -> None:
            if not os.read(stdin, 4096):  # end of file: the parent is gone; stop as on SIGTERM
                loop.remove_reader(stdin)
                os.kill(os.getpid(), signal.SIGTERM)

        loop.add_reader(stdin, on_stdin)
        telemetry = _telemetry("edgeserve-node", access_log=spec.access_log)
        device = spec.engine.get("device", "cpu")
        service = NodeService(
            NodeSettings(node_id=spec.node_id, address=spec.address,
                         internal_token=spec.internal_token),
            None,
            engine_factory=_engine_factory(**spec.engine),
            embedder_factory=None if spec.embedding_model is None
            else _embedder_factory(spec.embedding_model, device),
        )  # fmt: skip
        try:
            server = uvicorn_server(create_node_app(service, telemetry), [sock], limits)
            await run_servers([server], on_signal=service.begin_drain)
        finally:
            telemetry.shutdown()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
