"""The node's state behind its HTTP API: the engine once loaded, the heartbeat, draining."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx

from billing.events import UsageEvent
from billing.sink import UsageSink
from common.node_api import ErrorEvent, GenerateParams, GenerateRequest
from gpu_node.engine.handoff import KVHandoff
from scheduler.capacity import CapacityRecord, CapacityRegistry, check_node_id, load_estimate
from scheduler.sequence import SamplingParams

if TYPE_CHECKING:
    from gpu_node.engine.async_engine import AsyncEngine
    from gpu_node.engine.embedder import Embedder, EmbedQueue

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeSettings:
    node_id: str
    address: str  # the base URL gateways use to reach this node
    internal_token: str
    role: str = "mixed"
    heartbeat_s: float = 1.0
    ttl_s: float = 3.0  # a few heartbeats, so one late beat does not drop the node
    drain_timeout_s: float = 30.0
    # A registry call (a heartbeat's publish, the drain's removal) that takes longer is given
    # up, so a stuck connection can hold neither the heartbeat nor a shutdown; the record's
    # TTL then decides.
    registry_timeout_s: float = 5.0
    handoff_timeout_s: float = 120.0  # a prefill node's answer with a prompt's KV
    max_num_seqs: int = 16  # for the load estimate: how many requests make one batch

    def __post_init__(self) -> None:
        # It names the node's capacity record and every usage event the node serves.
        check_node_id(self.node_id)


class TokenRate:
    """Tokens per second over about the last `window_s` seconds, from a running count."""

    def __init__(self, window_s: float = 5.0) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, int]] = deque()

    def update(self, count: int, now: float) -> float:
        """The rate up to `now`, when the count reads `count`."""
        self._samples.append((now, count))
        # Keep the newest sample at least window_s old as the base of the rate.
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()
        then, before = self._samples[0]
        return (count - before) / (now - then) if now > then else 0.0


class NodeService:
    """The node's state: the engine once loaded, draining, the heartbeat and in-flight requests."""

    def __init__(
        self,
        settings: NodeSettings,
        registry: CapacityRegistry | None,
        engine: AsyncEngine | None = None,
        engine_factory: Callable[[], AsyncEngine] | None = None,
        usage_sink: UsageSink | None = None,
        embedder: Embedder | None = None,
        embedder_factory: Callable[[], Embedder] | None = None,
    ) -> None:
        self.settings = settings
        # An encoder served beside the engine (its name in the capacity record's models),
        # handed in or loaded with the engine.
        self.embedder = embedder
        self._embedder_factory = embedder_factory
        self._embed_queue: EmbedQueue | None = None
        # Where the node records what each request consumed here (a fleet's usage stream):
        # the record billing completes a stream from when its gateway died mid-answer.
        self.usage_sink = usage_sink
        self._recording: set[asyncio.Task[None]] = set()
        self.registry = registry
        self.engine = engine
        self._engine_factory = engine_factory
        # An engine handed in belongs to the caller (tests share one); a loaded one is ours to stop.
        self._owns_engine = engine is None
        self.is_draining = False
        self.load_error: str | None = None
        self.num_in_flight = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._token_rate = TokenRate()
        # A publish and the drain's removal never overlap: a heartbeat's record still on its
        # way to the registry (on another of the client's connections) would otherwise land
        # after the removal and bring a draining node back until its TTL.
        self._registry_lock = asyncio.Lock()

    @property
    def is_ready(self) -> bool:
        return self.engine is not None and not self.is_draining

    def embed_queue(self) -> EmbedQueue | None:
        """Where requests for the encoder wait to run together; None without one."""
        if self.embedder is None:
            return None
        if self._embed_queue is None:
            from gpu_node.engine.embedder import EmbedQueue

            self._embed_queue = EmbedQueue(self.embedder)
        return self._embed_queue

    @property
    def model_name(self) -> str:
        assert self.engine is not None
        return self.engine.model_name

    async def start(self) -> None:
        if self.engine is None and self._engine_factory is not None:
            self._tasks.append(asyncio.create_task(self._load()))
        if self.registry is not None:
            self._tasks.append(asyncio.create_task(self._heartbeat()))

    async def _load(self) -> None:
        assert self._engine_factory is not None
        try:
            if self.embedder is None and self._embedder_factory is not None:
                self.embedder = await asyncio.to_thread(self._embedder_factory)
            engine = await asyncio.to_thread(self._engine_factory)
            engine.start()
            self.engine = engine
            await self.publish()
        except Exception as exc:  # the node stays up and says why on /health
            log.exception("engine failed to load")
            self.load_error = f"{type(exc).__name__}: {exc}"

    def capacity_record(self) -> CapacityRecord | None:
        if self.engine is None:
            return None
        stats = self.engine.stats()
        return CapacityRecord(
            node_id=self.settings.node_id,
            address=self.settings.address,
            role=self.settings.role,
            models=(
                self.engine.model_name,
                *([self.embedder.name] if self.embedder is not None else []),
            ),
            num_pages=stats.num_pages,
            num_free_pages=stats.num_free_pages,
            page_size=stats.page_size,
            kv_dtype=stats.kv_dtype,
            activations=stats.activations,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            load=load_estimate(
                stats.num_pages, stats.num_free_pages, stats.num_waiting, self.settings.max_num_seqs
            ),
            published_at=time.time(),
            ttl_s=self.settings.ttl_s,
            max_request_tokens=self.engine.max_request_tokens,
            tokens_per_s=round(
                self._token_rate.update(stats.num_computed_tokens, time.monotonic()), 1
            ),
            generation_defaults={
                k: float(v) for k, v in self.engine.tokenizer.generation_defaults.items()
            },
            embedding_models=(
                {self.embedder.name: self.embedder.max_tokens} if self.embedder is not None else {}
            ),
        )

    def record_usage(self, event: UsageEvent) -> None:
        """Hands `event` to the usage sink in the background (a request's end never waits)."""
        if self.usage_sink is None:
            return
        task = asyncio.get_running_loop().create_task(self.usage_sink.record(event))
        self._recording.add(task)
        task.add_done_callback(self._recording.discard)

    async def publish(self) -> None:
        record = self.capacity_record()
        async with self._registry_lock:
            if self.registry is not None and record is not None and not self.is_draining:
                async with asyncio.timeout(self.settings.registry_timeout_s):
                    await self.registry.publish(record)

    async def _heartbeat(self) -> None:
        while not self.is_draining:
            try:
                await self.publish()
            except Exception:  # Redis away for a beat: the TTL decides, keep beating
                log.warning("capacity heartbeat failed", exc_info=True)
            await asyncio.sleep(self.settings.heartbeat_s)

    async def begin_drain(self) -> None:
        """Stop taking work and leave the registry so no gateway places here any more.

        The removal waits for a publish in flight (never lands before it). A publish given
        up on its timeout may still land later, on a connection that answered late: then
        the record lives until its TTL, and the node, draining, refuses what comes.
        """
        self.is_draining = True
        if self.registry is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.settings.registry_timeout_s):
                    async with self._registry_lock:
                        await self.registry.remove(self.settings.node_id)

    async def stop(self) -> None:
        await self.begin_drain()
        deadline = time.monotonic() + self.settings.drain_timeout_s
        while self.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._recording:  # what the drained requests consumed, recorded before leaving
            await asyncio.wait(set(self._recording), timeout=self.settings.drain_timeout_s)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        if self.engine is not None and self._owns_engine:
            await asyncio.to_thread(self.engine.shutdown)

    async def fetch_handoff(
        self, body: GenerateRequest, prompt_ids: list[int], trace_headers: Mapping[str, str]
    ) -> KVHandoff | tuple[str, str]:
        """The prompt's KV from the prefill node `body.prefill_from` names, or the error
        (code, message) to answer with: a prefill node that cannot be reached or is busy
        makes this call retryable elsewhere (over_capacity). `trace_headers` make the
        prefill node's span a child of this node's."""
        assert body.prefill_from is not None
        url = body.prefill_from.rstrip("/")
        payload = body.model_dump(exclude={"prefill_from", "prompt", "messages", "raw"})
        payload["prompt_token_ids"] = prompt_ids
        headers = {"authorization": f"Bearer {self.settings.internal_token}", **trace_headers}
        try:
            async with httpx.AsyncClient(timeout=self.settings.handoff_timeout_s) as client:
                response = await client.post(
                    f"{url}/internal/v1/prefill", json=payload, headers=headers
                )
        except httpx.HTTPError as exc:
            return "over_capacity", f"prefill node {url} unreachable: {type(exc).__name__}"
        if response.status_code != 200:
            try:
                error = ErrorEvent.model_validate_json(response.content).error
                code, message = error.code, error.message
            except ValueError:
                code, message = "internal", f"status {response.status_code}"
            return code, f"prefill node {url}: {message}"
        try:
            return KVHandoff.from_bytes(response.content)
        except ValueError as exc:
            return "internal", f"prefill node {url} sent no usable KV: {exc}"

    def prompt_token_ids(self, body: GenerateRequest) -> list[int]:
        assert self.engine is not None
        tokenizer = self.engine.tokenizer
        if body.prompt_token_ids is not None:
            return body.prompt_token_ids
        if body.messages is not None:
            messages = [m.model_dump(exclude_none=True) for m in body.messages]
            return tokenizer.encode_chat(messages, tools=body.tools)
        if body.raw:  # the client's own text, control tokens and all
            return tokenizer.encode(body.prompt or "")
        return tokenizer.encode_chat([{"role": "user", "content": body.prompt or ""}])


def sampling_params(params: GenerateParams) -> SamplingParams:
    """How the engine samples what `params` asks for."""
    return SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=params.seed,
        stop=tuple(params.stop),
        repetition_penalty=params.repetition_penalty,
        frequency_penalty=params.frequency_penalty,
        presence_penalty=params.presence_penalty,
        logprobs=params.logprobs,
        top_logprobs=params.top_logprobs,
    )
