"""The autoscaling gauges on a real gateway's /metrics (gateway/dashboard/fleet.py); the KEDA
example that acts on them: tests/infra/test_k8s.py.

Nodes are capacity records published to the registry, as a node publishes them; the one
serving smollm2 is full (no room to reserve), so the requests sent wait in the gateway's
capacity queue until their deadline.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import create_app
from gateway.dashboard import ModelLoad, model_loads
from gateway.keys import MemoryKeyStore
from gateway.settings import GatewaySettings
from scheduler.capacity import CapacityRecord, CapacityView, LocalCapacityRegistry
from scheduler.placement import LocalReservations, Placer
from tests.conftest import SMOLLM2, ServerThread, free_port

KEY = "es-autoscaling-key"
AUTH = {"authorization": f"Bearer {KEY}"}
RUN_SMOL = f"/client/v4/accounts/acct/ai/run/{SMOLLM2}"
GAUGES = (
    "edgeserve_queue_waiting_requests",
    "edgeserve_model_waiting_requests",
    "edgeserve_model_running_requests",
    "edgeserve_model_kv_utilization_ratio",
    "edgeserve_model_nodes",
)


def record(node_id: str, models: tuple[str, ...], **numbers: Any) -> CapacityRecord:
    return CapacityRecord(
        node_id=node_id, address=f"http://127.0.0.1:{free_port()}", role="mixed", models=models,
        page_size=16, kv_dtype="fp32", load=1.0, published_at=time.time(), ttl_s=120.0,
        activations="fp32", **numbers,
    )  # fmt: skip


def gauges(url: str) -> dict[tuple[str, str], float]:
    """(metric, model label or "") -> value, for the autoscaling gauges."""
    text = httpx.get(f"{url}/metrics").text
    return {
        (sample.name, sample.labels.get("model", "")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in GAUGES
    }


def test_model_loads_sum_each_model_over_the_nodes_serving_it() -> None:
    a = record("a", ("smollm2",), num_pages=100, num_free_pages=25, num_running=3, num_waiting=2)
    b = record("b", ("qwen", "smollm2"), num_pages=50, num_free_pages=50, num_running=0,
               num_waiting=1)  # fmt: skip
    assert model_loads([a, b]) == (
        ModelLoad("qwen", num_nodes=1, num_pages=50, num_free_pages=50, num_running=0,
                  num_waiting=1),
        ModelLoad("smollm2", num_nodes=2, num_pages=150, num_free_pages=75, num_running=3,
                  num_waiting=3),
    )  # fmt: skip
    assert [m.kv_utilization for m in model_loads([a, b])] == [0.0, 0.5]
    assert model_loads([]) == ()


def test_the_gauges_say_what_the_records_and_the_queue_hold() -> None:
    """Three requests wait in the queue (the node has no room), then give up at their
    deadline: the queue gauge reads 3, then 0; the model gauges read the records' sums, and
    a model no node serves any more drops out."""
    registry = LocalCapacityRegistry()
    full = record("full", ("smollm2",), num_pages=64, num_free_pages=0, num_running=4,
                  num_waiting=5)  # fmt: skip
    other = record("other", ("qwen",), num_pages=40, num_free_pages=30, num_running=1,
                   num_waiting=0)  # fmt: skip
    asyncio.run(registry.publish(full))
    asyncio.run(registry.publish(other))
    keys = MemoryKeyStore()
    asyncio.run(keys.add(KEY, "acct"))
    placer = Placer(CapacityView(registry, max_age_s=0.0), LocalReservations(), overcommit=0.001)
    settings = GatewaySettings(internal_token="t", queue_deadline_s=3.0)
    server = ServerThread(create_app(settings, keys=keys, placer=placer)).start()
    statuses: list[int] = []

    def send() -> None:
        answer = httpx.post(server.url + RUN_SMOL, json={"prompt": "hi", "max_tokens": 4},
                            headers=AUTH, timeout=30)  # fmt: skip
        statuses.append(answer.status_code)

    try:
        assert gauges(server.url) == {
            ("edgeserve_queue_waiting_requests", ""): 0.0,
            ("edgeserve_model_waiting_requests", "qwen"): 0.0,
            ("edgeserve_model_waiting_requests", "smollm2"): 5.0,
            ("edgeserve_model_running_requests", "qwen"): 1.0,
            ("edgeserve_model_running_requests", "smollm2"): 4.0,
            ("edgeserve_model_kv_utilization_ratio", "qwen"): 0.25,
            ("edgeserve_model_kv_utilization_ratio", "smollm2"): 1.0,
            ("edgeserve_model_nodes", "qwen"): 1.0,
            ("edgeserve_model_nodes", "smollm2"): 1.0,
        }
        senders = [threading.Thread(target=send) for _ in range(3)]
        for sender in senders:
            sender.start()
        deadline = time.monotonic() + 2.5
        while gauges(server.url)[("edgeserve_queue_waiting_requests", "")] < 3:
            assert time.monotonic() < deadline, "the requests never queued"
            time.sleep(0.05)
        asyncio.run(registry.remove("other"))
        asyncio.run(registry.publish(record("full", ("smollm2",), num_pages=64, num_free_pages=16,
                                            num_running=3, num_waiting=7)))  # fmt: skip
        assert gauges(server.url) == {
            ("edgeserve_queue_waiting_requests", ""): 3.0,
            ("edgeserve_model_waiting_requests", "smollm2"): 7.0,
            ("edgeserve_model_running_requests", "smollm2"): 3.0,
            ("edgeserve_model_kv_utilization_ratio", "smollm2"): 0.75,
            ("edgeserve_model_nodes", "smollm2"): 1.0,
        }
        for sender in senders:
            sender.join(timeout=30)
        assert statuses == [429, 429, 429]  # waited out the 3 s deadline: no capacity
        assert gauges(server.url)[("edgeserve_queue_waiting_requests", "")] == 0.0
        text = httpx.get(f"{server.url}/metrics").text
        assert 'edgeserve_admission_rejections_total{reason="no_capacity"} 3.0' in text
    finally:
        server.stop()
