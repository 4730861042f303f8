"""The fleet as one gateway sees it, and the gauges an autoscaler acts on.

Read from the capacity registry (every node's `CapacityRecord`) and this gateway's
capacity queue, on each `/metrics` scrape and each dashboard poll:

    edgeserve_queue_waiting_requests               requests waiting in this gateway's queue
    edgeserve_model_waiting_requests{model}        requests the nodes serving `model` queue
    edgeserve_model_running_requests{model}        requests those nodes run
    edgeserve_model_kv_utilization_ratio{model}    used / total KV pages of those nodes
    edgeserve_model_nodes{model}                   live nodes serving `model`

`model` is the node model a record names (what a node deployment serves). The per-model
gauges are fleet-wide (every gateway reads the same registry) and absent while the
registry does not answer; the queue gauge is this gateway's own.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Gauge
from redis.exceptions import RedisError

from gateway.admission import CapacityQueue
from scheduler.capacity import CapacityRecord
from scheduler.placement import Placer
from scheduler.store_watch import is_store_unavailable


@dataclass(frozen=True, slots=True)
class ModelLoad:
    """The live nodes serving one model, summed."""

    model: str
    num_nodes: int
    num_pages: int
    num_free_pages: int
    num_running: int
    num_waiting: int

    @property
    def kv_utilization(self) -> float:
        """Used pages over all pages, 0..1 (0 with no pages)."""
        if not self.num_pages:
            return 0.0
        return (self.num_pages - self.num_free_pages) / self.num_pages


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    nodes: tuple[CapacityRecord, ...]
    models: tuple[ModelLoad, ...]
    num_queued: int  # this gateway's capacity queue
    is_registry_away: bool  # nodes and models unknown (empty), not none


def model_loads(records: Iterable[CapacityRecord]) -> tuple[ModelLoad, ...]:
    """Per-model totals over `records`, in model name order; a node serving two models
    counts in both."""
    sums: dict[str, list[int]] = {}
    for r in records:
        for model in r.models:
            s = sums.setdefault(model, [0, 0, 0, 0, 0])
            s[0] += 1
            s[1] += r.num_pages
            s[2] += r.num_free_pages
            s[3] += r.num_running
            s[4] += r.num_waiting
    return tuple(ModelLoad(model, *sums[model]) for model in sorted(sums))


class FleetGauges:
    """Reads the fleet (`refresh`) and keeps the autoscaling gauges on `registry` in step."""

    def __init__(
        self, placer: Placer, queue: CapacityQueue[Any], registry: CollectorRegistry
    ) -> None:
        self._placer = placer
        self._queue = queue
        self.queue_waiting = Gauge(
            "edgeserve_queue_waiting_requests",
            "Requests waiting in this gateway's capacity queue for a node with room.",
            registry=registry,
        )
        self.model_waiting = Gauge(
            "edgeserve_model_waiting_requests",
            "Requests waiting on the live nodes serving the model (their capacity records).",
            ("model",),
            registry=registry,
        )
        self.model_running = Gauge(
            "edgeserve_model_running_requests",
            "Requests running on the live nodes serving the model.",
            ("model",),
            registry=registry,
        )
        self.model_kv_utilization = Gauge(
            "edgeserve_model_kv_utilization_ratio",
            "Used over total KV cache pages of the live nodes serving the model (0..1).",
            ("model",),
            registry=registry,
        )
        self.model_nodes = Gauge(
            "edgeserve_model_nodes",
            "Live nodes serving the model.",
            ("model",),
            registry=registry,
        )

    async def refresh(self) -> FleetSnapshot:
        """The fleet now; the gauges say the same afterwards."""
        is_away = False
        try:
            nodes = tuple(await self._placer.nodes())
        except (RedisError, OSError) as exc:
            if isinstance(exc, RedisError) and not is_store_unavailable(exc):
                raise
            nodes, is_away = (), True
        snapshot = FleetSnapshot(nodes, model_loads(nodes), self._queue.num_waiting, is_away)
        self._publish(snapshot)
        return snapshot

    def _publish(self, snapshot: FleetSnapshot) -> None:
        # No await between clearing and setting: a scrape never sees a model half-written.
        self.queue_waiting.set(snapshot.num_queued)
        gauges = (self.model_waiting, self.model_running, self.model_kv_utilization)
        for gauge in (*gauges, self.model_nodes):
            gauge.clear()  # a model no node serves any more drops out
        for load in snapshot.models:
            self.model_waiting.labels(load.model).set(load.num_waiting)
            self.model_running.labels(load.model).set(load.num_running)
            self.model_kv_utilization.labels(load.model).set(load.kv_utilization)
            self.model_nodes.labels(load.model).set(load.num_nodes)
